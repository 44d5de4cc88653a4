"""The vLLM side of `make interop`: run prompts (token ids) through vLLM offline, greedy, plain and with drafters.

Runs in vLLM's own venv (it imports vllm, never dspark); scripts/interop_vllm.py writes its input and reads its
output. Input JSON: {"target": DIR, "dtype": "float32", "max_tokens": 128, "prompts": [[ids], ...],
"runs": [{"name": "plain", "speculative_config": null}, {"name": ..., "speculative_config": {...}}, ...]}.
Output JSON: {"vllm_version", "runs": {name: {"outputs": [[ids], ...], "num_drafts", "num_draft_tokens",
"num_accepted_tokens", "seconds"}}}. The counters are vLLM's own (``LLM.get_metrics()``:
``vllm:spec_decode_num_drafts`` and friends); acceptance length = 1 + accepted / drafts.

usage: $VLLM_VENV/bin/python scripts/interop_vllm_engine.py IN.json OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def _counters(llm) -> dict[str, int]:
    out = {v: 0 for v in COUNTERS.values()}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
    return out


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result = {"vllm_version": vllm.__version__, "runs": {}}
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    for item in spec["runs"]:
        t0 = time.perf_counter()
        llm = LLM(model=spec["target"], dtype=spec.get("dtype", "float32"), seed=0, max_model_len=2048,
                  speculative_config=item.get("speculative_config"), disable_log_stats=False,
                  enforce_eager=True, distributed_executor_backend="uni")
        outs = llm.generate(prompts, params, use_tqdm=False)
        counters = _counters(llm)
        result["runs"][item["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs], **counters,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"vllm {item['name']}: {counters} in {result['runs'][item['name']]['seconds']} s", flush=True)
        del llm
        gc.collect()
    return result


if __name__ == "__main__":  # vLLM's offline engine spawns its engine process: the guard is required
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    out = run(spec)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)
