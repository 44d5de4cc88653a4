"""DSpark: lossless speculative decoding with semi-autoregressive drafters.

Folder layout follows the architecture: ``target`` (the frozen model being
accelerated), ``modeling`` (decoder building blocks shared by target and
drafters), ``sampling`` (logit processing and the rejection sampler),
``drafters``, ``generation`` (the speculative loop), ``training``,
``evaluation``, ``scheduler`` (SPS table and verify-length policies),
``serving`` (engine and HTTP server).
"""

__version__ = "0.1.0"
