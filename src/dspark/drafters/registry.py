"""Turn a user's ``--drafter`` value into a drafter for a target.

Accepted values: ``none`` (plain decoding), ``prompt-lookup``, a DSpark /
DFlash / Eagle3 checkpoint folder (dispatch on ``architectures[0]`` as
DeepSpec's eval does), or any HF causal-LM folder (an independent draft model).
"""

from __future__ import annotations

from pathlib import Path

from dspark.drafters.base import Drafter, NoDrafter
from dspark.drafters.options import DraftingOptions
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.errors import ModelLoadError
from dspark.modeling.weights import read_config

BUILTIN = ("none", "prompt-lookup")



def drafter_kind(path: Path) -> str:
    """'dspark' (incl. DFlash, which is DSpark without heads), 'eagle3' or 'draft-model'."""
    arch = (read_config(path).get("architectures") or [""])[0]
    if "DSpark" in arch or "DFlash" in arch:
        return "dspark"
    if "Eagle3" in arch:
        return "eagle3"
    return "draft-model"


def load_drafter(spec: str, target, options: DraftingOptions | None = None) -> Drafter:
    """The drafter ``spec`` names, for ``target``, drafting as ``options`` say (see ``DraftingOptions``)."""
    options = options or DraftingOptions()
    block_size, head_top_m, draft_vocab = options.block_size, options.head_top_m, options.draft_vocab
    if spec == "none":
        return NoDrafter(target.vocab_size)
    if spec == "prompt-lookup":
        return PromptLookupDrafter(target.vocab_size, block_size or 7)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"--drafter {spec!r}: not one of {', '.join(BUILTIN)} and no such folder"
        )
    kind = drafter_kind(path)
    if kind == "dspark":
        from dspark.drafters.dspark.drafter import load_dspark_drafter

        from dspark.drafters.draft_vocab import load_draft_vocab

        vocab = load_draft_vocab(draft_vocab, target.vocab_size) if draft_vocab else None
        return load_dspark_drafter(path, target, block_size, head_top_m or None, vocab)
    if kind == "eagle3":
        from dspark.drafters.eagle3.drafter import load_eagle3_drafter

        return load_eagle3_drafter(path, target, block_size)
    from dspark.drafters.draft_lm.drafter import load_draft_model

    return load_draft_model(str(path), target, block_size or 4, target.dtype)
