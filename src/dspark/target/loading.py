"""How the decoding commands and ``dspark.load`` load a target: the device, the dtype and the decoding layout.

The drafter follows the target's device and dtype (its loaders move it there). The device defaults to cuda
when a GPU is available, else cpu; the dtype to bfloat16 on cuda and float32 on cpu (``resolve_device``,
``default_dtype_name``). bfloat16 changes the target itself: greedy output is the bf16 target's, which can
differ from the float32 target's after a while. Lossless still means "the same distribution as this target".
The command-line flags that choose these live in ``dspark.cli_options``.

No torch import at module level: the CLI imports this while it builds its parsers.
"""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16")
DEVICE_NAMES = ("auto", "cpu", "cuda")  # one GPU of many: CUDA_VISIBLE_DEVICES


def resolve_device(name: str | None = "auto") -> str:
    """``--device`` (or a training config's ``device``) as "cpu" or "cuda": auto (or None) = cuda when a GPU
    is available, else cpu. Asking for cuda where torch sees no GPU is a user error (``DSparkError``)."""
    import torch

    from dspark.errors import DSparkError

    name = name or "auto"
    if name not in DEVICE_NAMES:
        raise DSparkError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DSparkError(f"--device cuda: no CUDA GPU is available to torch {torch.__version__} here; "
                          "use --device cpu")
    return name


def default_dtype_name(device: str) -> str:
    """bfloat16 on a GPU (what its tensor cores run), float32 on the CPU (bitwise-comparable with HF)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_decoding_target(name_or_path: str, device: str | None = "auto", dtype: str | None = None,
                         compile: bool = False, tokenizer: bool = True):
    """The target as every decoding command loads it (the CLI through ``dspark.cli_options.load_target_from_args``,
    ``dspark.load`` directly): on ``device`` (auto = cuda when a GPU is available), in ``dtype`` (None = bfloat16
    on cuda, float32 on cpu), in the decoding layout (q/k/v and gate/up fused, weights prepacked unless
    ``compile``) with one-token steps computed as verify blocks compute their rows (``batch_invariant``),
    ``torch.compile``d decoder layers with ``compile``. ``dspark.target.model.load_target``'s own defaults are the
    plain layout."""
    from dspark.errors import DSparkError
    from dspark.target.model import load_target

    device = resolve_device(device)
    dtype = dtype or default_dtype_name(device)
    if dtype not in DTYPE_NAMES:
        raise DSparkError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_NAMES)}")
    target = load_target(name_or_path, dtype=torch_dtype(dtype), tokenizer=tokenizer, device=device,
                         fuse=True, batch_invariant=True, pack=not compile)
    if compile:
        from dspark.modeling.compile import compile_decoder

        compile_decoder(target.model)
    return target
