"""Time the fused CPU kernels (dspark.modeling.cpu_kernels) against the torch ops they replace, in one process.

    PYTHONPATH=src python scripts/cpu_kernels.py [--out docs/reports/cpu-kernels.md] [--steps 20]
    PYTHONPATH=src python scripts/cpu_kernels.py --compare attention [--out docs/reports/cpu-attention-kernel.md]

The default target (SmolLM2-135M) in the decoding layout, bfloat16, one thread: the median wall time of a plain
decode step at batch 1, 4, 16 and 32 (every request CONTEXT tokens into its cache, or with ``--spread`` contexts
from CONTEXT/2 to 3*CONTEXT/2 across the batch, as a server's requests are) and of whole-prompt prefills (PROMPT: lengths), with the
two paths alternated call by call so that both see the same machine; and the greedy agreement of the two paths
(the share of 64 greedy tokens, 4 prompts, that both emit alike). ``--compare elementwise`` (default):
``Decoder.cpu_kernels`` off and on (the attention kernel off in both); ``--compare attention``: the element-wise
kernels on in both, attention by torch's fused SDPA or by the C kernel (``Decoder.attention_kernel``). Writes a
Markdown page with the command.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.modeling import cpu_kernels
from dspark.tables import markdown_table
from dspark.target.loading import load_decoding_target


def cpu_name() -> str:
    """The CPU's model name (Linux), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="Markdown page to write (default: print only)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per cell and path")
    p.add_argument("--context", type=int, default=250, help="tokens in each request's cache for the decode steps")
    p.add_argument("--prompt", default="250,1000", help="prefill lengths, comma-separated")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--compare", choices=["elementwise", "attention"], default="elementwise",
                   help="which kernels the two paths differ by")
    p.add_argument("--spread", action="store_true", help="contexts from CONTEXT/2 to 3*CONTEXT/2 across a batch")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not cpu_kernels.available():
        sys.exit("the fused CPU kernels are not available here (no C compiler, or DSPARK_CPU_KERNELS=0)")
    target = load_decoding_target("smollm2-135m", device="cpu", dtype="bfloat16", tokenizer=False)
    decoder = target.model.model
    attention_kernel = decoder.attention_kernel

    def use(on: bool) -> None:  # the path under test: off = the baseline
        if args.compare == "elementwise":
            decoder.cpu_kernels, decoder.attention_kernel = on, False
        else:
            decoder.cpu_kernels, decoder.attention_kernel = True, on and attention_kernel

    if args.compare == "attention" and not attention_kernel:
        sys.exit("the attention kernel does not take this model here (DSPARK_ATTENTION_KERNEL=0?)")
    gen = torch.Generator().manual_seed(0)
    prompts = [int(n) for n in args.prompt.split(",")]

    def timed(fn, on: bool) -> float:
        use(on)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = []
    for R in [int(b) for b in args.batches.split(",")]:
        contexts = [args.context * (2 * R + 2 * r - R) // (2 * R) if args.spread and R > 1 else args.context
                    for r in range(R)]  # spread: from CONTEXT/2 up to nearly 3*CONTEXT/2
        ids = torch.randint(100, 49000, (max(contexts),), generator=gen)
        caches = {on: [target.new_cache(max(contexts) + 2 * args.steps + 8) for _ in range(R)] for on in (False, True)}
        for on in (False, True):
            use(on)
            target.forward(torch.cat([ids[:n] for n in contexts]), contexts, caches[on], logits_for="none")
        step_ids = torch.randint(100, 49000, (R,), generator=gen)
        times = {False: [], True: []}
        for i in range(args.steps + 2):
            for on in (False, True):
                dt = timed(lambda: target.forward(step_ids, [1] * R, caches[on], logits_for="all"), on)
                if i >= 2:
                    times[on].append(dt)
        off, on_ = (1000 * statistics.median(times[k]) for k in (False, True))
        rows.append([f"decode step, batch {R}", f"{off:.1f}", f"{on_:.1f}", f"{off / on_:.2f}x"])
        print(rows[-1], flush=True)
    for n in prompts:  # a whole prompt in one pass, every row through the path under test (no prompt_from)
        ids = torch.randint(100, 49000, (n,), generator=gen)
        times = {False: [], True: []}
        for i in range(max(3, args.steps // 4) + 1):
            for on in (False, True):
                dt = timed(lambda: target.forward(ids, [n], [target.new_cache(n + 8)], logits_for="last"), on)
                if i >= 1:
                    times[on].append(dt)
        off, on_ = (1000 * statistics.median(times[k]) for k in (False, True))
        rows.append([f"prefill of {n} tokens", f"{off:.1f}", f"{on_:.1f}", f"{off / on_:.2f}x"])
        print(rows[-1], flush=True)

    # greedy agreement: the same prompts decoded greedily by both paths
    same = total = 0
    for s in range(4):
        prompt = torch.randint(100, 49000, (32,), generator=torch.Generator().manual_seed(10 + s))
        texts = {}
        for on in (False, True):
            use(on)
            cache = [target.new_cache(128)]
            tok = target.forward(prompt, [32], cache, logits_for="last").logits.argmax(-1)
            out = []
            for _ in range(64):
                out.append(int(tok))
                tok = target.forward(tok, [1], cache, logits_for="all").logits.argmax(-1)
            texts[on] = out
        agree = next((i for i, (a, b) in enumerate(zip(texts[False], texts[True])) if a != b), 64)
        same += agree
        total += 64
    command = "PYTHONPATH=src python scripts/cpu_kernels.py " + " ".join(sys.argv[1:])
    if args.compare == "elementwise":
        title, base, test = "Fused CPU kernels", "torch ops", "kernels"
        paths = ("`torch ops`: `Decoder.cpu_kernels` off (RMSNorm, RoPE, residual adds, SiLU and the gate product as "
                 "torch ops); `kernels`: on (src/dspark/modeling/cpu_kernels.py); attention by torch's fused SDPA in "
                 "both.")
        why = ("the kernels sum RMSNorm's squares in another order and compute exp with their own polynomial, so a "
               "norm or SiLU output moves by one bf16 step now and then")
    else:
        title, base, test = "The C attention kernel", "SDPA", "C kernel"
        paths = ("The element-wise kernels on in both; `SDPA`: attention by torch's fused kernel, one call per run "
                 "of consecutive slots, keys padded to the run's longest request (`fused_cpu_attention`); `C kernel`: "
                 "`cpu_kernels.attention`, one call for the whole batch, every (token, head) row over its own keys "
                 "(`Decoder.attention_kernel`).")
        why = ("the kernel sums scores and weighted values in float32 in its own order and normalises once, so an "
               "attention output can differ from SDPA's by a bf16 step")
        route = "the C kernel" if cpu_kernels.prompts_to_kernel() else "SDPA"
        paths += (" The prefill rows put every prompt row through the path under test; the engine sends prompt "
                  "pieces to SDPA on CPUs with AMX tiles and to the C kernel elsewhere (`cpu_kernels.prompts_to_kernel`"
                  f", `DSPARK_PROMPT_ATTENTION`): on this CPU ({cpu_name()}, AMX "
                  f"{'yes' if cpu_kernels.has_amx() else 'no'}) to {route}.")
    spread = (f"contexts from {args.context // 2} to {3 * args.context // 2} tokens across the batch"
              if args.spread else f"{args.context} tokens in every request's cache")
    page = "\n".join([
        f"# {title}",
        "",
        f"Written by `{command.strip()}` (torch {torch.__version__}, one thread, bfloat16; median of {args.steps} "
        f"calls per cell, the two paths alternated call by call in one process). SmolLM2-135M in the decoding "
        f"layout; decode steps with {spread}, logits for every row. {paths}",
        "",
        *markdown_table(["call", f"{base} (ms)", f"{test} (ms)", "speed-up"], rows),
        "",
        f"Greedy agreement: of 4 x 64 greedy tokens after random 32-token prompts, the two paths emit the same first "
        f"{same} of {total} (a path is one bf16 model; {why}, and a greedy text can leave the other path's at a "
        "near-tie). Each path is load-independent on its own "
        "(tests/modeling/test_cpu_kernels.py, tests/modeling/test_attention.py).",
        "",
    ])
    print(page)
    if args.out:
        Path(args.out).write_text(page)


if __name__ == "__main__":
    main()
