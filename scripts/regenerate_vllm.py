"""`dspark data regenerate --base-url` against vLLM's OpenAI server on this machine, next to the in-process path.

    VLLM_VENV=/work/vllm-venv python scripts/regenerate_vllm.py --threads 1 --num 32 --multi-turn 8 --max-new-tokens 128

1. builds --num training prompts from the offline sources (`dspark data prompts`, seed 0), plus --multi-turn
   two-turn conversations made of further ones (every other one with a system message);
2. regenerates them in process, greedy (the continuous-batching engine, --batch-size, the target as
   `dspark data regenerate` loads it: float32 on a CPU), timing the regeneration only;
3. for each of --vllm-dtypes, starts vLLM's OpenAI server from $VLLM_VENV (`python -m
   vllm.entrypoints.openai.api_server --model DIR --dtype DTYPE --enforce-eager`, 127.0.0.1), sends one warm-up
   chat request, regenerates the same prompts through it with `regenerate_over_http` (what `dspark data
   regenerate --base-url` runs, --concurrency conversations in flight), timing the regeneration only, and stops
   the server;
4. counts the records equal to the in-process ones; for each record that differs it finds the first differing
   token of the first differing message and the in-process target's logit gap there between the two engines'
   choices (a near tie that rounding breaks either way), so every difference is explained or shown not to be one;
5. writes the table between the markers in --doc (docs/reports/data-throughput.md) and the per-record results to --details
   (docs/interop/regenerate-vllm.json).

Without VLLM_VENV, --vllm-python (default .venv-vllm/bin/python, as `make interop` makes it) must have vLLM's CPU
build 0.32.0; a missing or other vLLM stops the script with one line saying what to install (exit 2).
--reuse keeps the prompts and every finished run (records and timings) of an earlier run in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_vllm import VLLM_VERSION, check_vllm as _check_vllm, write_between  # noqa: E402
START, END = "<!-- regenerate-vllm:start -->", "<!-- regenerate-vllm:end -->"


def default_vllm_python() -> str:
    venv = os.environ.get("VLLM_VENV")
    return str(Path(venv) / "bin" / "python") if venv else str(ROOT / ".venv-vllm" / "bin" / "python")


def check_vllm(python: str) -> str:
    """interop_vllm's check, this script named in its one line."""
    return _check_vllm(python, Path(sys.argv[0]).stem)


def _http(url: str, body: dict | None = None, timeout: float = 10) -> str:
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None,
                                 {"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1 while entered; the whole process group is stopped on exit."""

    def __init__(self, python: str, model: str, port: int, dtype: str, log: Path, wait_s: float) -> None:
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
                     "--enforce-eager", "--seed", "0", "--max-model-len", "4096",
                     "--host", "127.0.0.1", "--port", str(port)]
        self.base = f"http://127.0.0.1:{port}"
        self.log_path, self.wait_s = log, wait_s
        self.proc: subprocess.Popen | None = None
        self.ready_s = 0.0

    def __enter__(self) -> "VllmServer":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        print("+ " + " ".join(shlex.quote(a) for a in self.argv), flush=True)
        self._log = self.log_path.open("w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"vLLM's server exited with {self.proc.returncode}; see {self.log_path}")
                if time.monotonic() - t0 > self.wait_s:
                    raise SystemExit(f"vLLM's server did not answer /health in {self.wait_s:.0f} s; "
                                     f"see {self.log_path}")
                try:
                    _http(self.base + "/health")
                    break
                except OSError:
                    time.sleep(2)
        except BaseException:
            self.__exit__()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def metrics(self) -> dict[str, float]:
        """vLLM's token counters summed over labels (``vllm:generation_tokens_total`` and friends)."""
        out: dict[str, float] = {}
        for line in _http(self.base + "/metrics").splitlines():
            if line.startswith(("vllm:generation_tokens_total", "vllm:prompt_tokens_total")):
                name = line.split("{")[0].split(" ")[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def add_multi_turn(prompts: Path, num: int, pairs: int) -> None:
    """Keep the first ``num`` prompts and turn the next ``2 * pairs`` into two-turn conversations (an original
    assistant turn between, which regeneration drops; a system message on every other one), so the history and
    system paths go through the server too."""
    recs = [json.loads(line) for line in prompts.read_text().splitlines()]
    out = recs[:num]
    for i in range(pairs):
        first, second = (r["conversations"][-1]["content"] for r in recs[num + 2 * i: num + 2 * i + 2])
        system = [{"role": "system", "content": "You are a concise assistant."}] if i % 2 == 0 else []
        out.append({"id": f"two-turn-{i}", "conversations": system + [
            {"role": "user", "content": first}, {"role": "assistant", "content": "(dropped)"},
            {"role": "user", "content": second}]})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in out))


def records(path: Path) -> dict[str, dict]:
    return {str(r["id"]): r for r in map(json.loads, path.read_text().splitlines()) if r}


def first_difference(target, a: dict, b: dict, same_dtype=None) -> dict:
    """Where two records' conversations part: message, token index (re-tokenized replies) and the in-process
    float32 target's logits there (the top two, the gap between the two tokens chosen); with ``same_dtype`` (our
    target in the other engine's dtype) also the token that one picks there."""
    import torch

    from dspark.data.regenerate_engine import encode_conversation

    tok = target.tokenizer
    ca, cb = a["conversations"], b["conversations"]
    turn = next(i for i, (x, y) in enumerate(zip(ca, cb)) if x != y) if ca[: len(cb)] != cb[: len(ca)] else None
    if turn is None:
        return {"turn": None, "why": f"one conversation is longer ({len(ca)} vs {len(cb)} messages)"}
    if ca[turn]["role"] != "assistant":
        return {"turn": turn, "why": "differs in a non-assistant message"}
    ta = tok.encode(ca[turn]["content"], add_special_tokens=False)
    tb = tok.encode(cb[turn]["content"], add_special_tokens=False)
    k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    prompt = encode_conversation(target, ca[:turn])
    ids = torch.tensor(prompt + ta[:k], dtype=torch.long)

    def last_logits(model) -> torch.Tensor:  # (V,)
        with torch.no_grad():
            return model.forward(ids, [len(ids)], None, logits_for="last").logits[0].float()

    logits = last_logits(target)
    top = torch.topk(logits, 2)
    pick = lambda t: t[k] if k < len(t) else None  # noqa: E731 (None: that reply ended there)
    in_proc, served = pick(ta), pick(tb)
    out = {
        "turn": turn, "token": k, "in_process_token": in_proc, "vllm_token": served,
        "top2": [int(i) for i in top.indices], "top2_gap": round(float(top.values[0] - top.values[1]), 4),
        "logit_gap_between_choices": (round(float(logits[in_proc] - logits[served]), 4)
                                      if in_proc is not None and served is not None else None),
    }
    if same_dtype is not None:
        other = last_logits(same_dtype)
        out["same_dtype_in_process_token"] = int(other.argmax())
        if out["logit_gap_between_choices"] is not None:
            out["same_dtype_gap_between_choices"] = round(float(other[in_proc] - other[served]), 4)
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def _why(run: dict, details: str) -> str:
    """What the differing records of one vLLM run have in common, from ``first_difference``."""
    diffs, dtype = run["differences"], run["dtype"]
    if not diffs:
        return f"vLLM in {dtype}: every record equal to the in-process one."
    located = [d for d in diffs if d.get("logit_gap_between_choices") is not None]
    # the re-tokenized in-process reply is the float32 argmax path where it parts, unless its text tokenizes
    # differently from the ids the engine generated: then the place found is not where the engines parted
    exact = [d for d in located if d["in_process_token"] == d["top2"][0]]
    if not exact:
        return f"vLLM in {dtype}: {len(diffs)} records differ; per record: {details}."
    gaps = sorted(abs(d["logit_gap_between_choices"]) for d in exact)
    second = sum(d["vllm_token"] == d["top2"][1] for d in exact)
    cause = ("two float32 implementations with different kernels (vLLM's CPU attention and GEMMs against ours) "
             "round such near ties either way" if dtype == "float32" else
             f"vLLM computes in {dtype}, whose rounding (8 significant bits) moves such gaps by as much")
    text = (f"vLLM in {dtype}: the {len(diffs)} records that differ part where the float32 target's two best tokens "
            f"are close. At the first differing token of the re-tokenized replies ({len(exact)} records; "
            f"{len(diffs) - len(exact)} more below), the in-process float32 target's logits for the two engines' "
            f"choices are {gaps[0]:.3f} to {gaps[-1]:.3f} apart (median {_median(gaps):.3f}; "
            f"{sum(g < 0.2 for g in gaps)} under 0.2), and vLLM's choice is the float32 target's second-best token "
            f"in {second} of them; {cause}. Everything after that token follows from it.")
    ours = [d for d in exact if "same_dtype_gap_between_choices" in d]
    if ours:
        shifts = [abs(d["same_dtype_gap_between_choices"] - d["logit_gap_between_choices"]) for d in ours]
        text += (f" Our own target loaded in {dtype} (`--dtype {dtype}`), run on the same prefix, picks vLLM's token "
                 f"at {sum(d['same_dtype_in_process_token'] == d['vllm_token'] for d in ours)} of these "
                 f"{len(ours)} positions and the float32 one's at "
                 f"{sum(d['same_dtype_in_process_token'] == d['in_process_token'] for d in ours)}; its gap between "
                 f"the two choices is off the float32 gap by {_median(shifts):.3f} (median; up to {max(shifts):.3f}).")
        large = [d for d in ours if abs(d["logit_gap_between_choices"]) >= 0.2]
        if large:
            pairs = "; ".join(f"{abs(d['logit_gap_between_choices']):.3f}, ours in {dtype} "
                              f"{abs(d['same_dtype_gap_between_choices']):.3f}" for d in large)
            text += (f" {len(large)} gaps are 0.2 or more ({pairs}): there vLLM's {dtype} rounding moved the gap "
                     "further than ours does.")
    retok = [d for d in diffs if d not in exact]
    if retok:
        text += (f" In {len(retok)} record(s) the re-tokenized float32 reply is not the float32 argmax at the token "
                 "found (its text tokenizes differently from the generated ids), so the place shown is not where the "
                 "engines parted; " + ", ".join(f"`{d['id']}`" for d in retok) + ".")
    return text + f" Per record: {details}."


def write_doc(doc: Path, result: dict, command: str, details: str) -> None:
    ip, n = result["in_process"], result["records"]
    rows = [
        "| path | records | answer tokens | seconds | answer tokens/s | vs in process | records equal to in process |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| in process (engine, batch {ip['batch']}, float32) | {ip['succeeded']} | {ip['new_tokens']} | "
        f"{ip['seconds']:.1f} | {ip['rate']:.1f} | 1.00x | {n}/{n} |",
    ]
    for vl in result["vllm"]:
        rows.append(f"| vLLM {vl['version']} OpenAI server (`--base-url`, concurrency {vl['concurrency']}, "
                    f"{vl['dtype']}) | {vl['succeeded']} | {vl['new_tokens']} | {vl['seconds']:.1f} | "
                    f"{vl['rate']:.1f} | {vl['rate'] / ip['rate']:.2f}x | {vl['equal']}/{n} |")
    loads = ", ".join(f"{step['name']} {step['load_before']} to {step['load_after']}"
                      for step in [ip, *result["vllm"]])
    starts = ", ".join(f"{vl['ready_s']:.0f} s in {vl['dtype']}" for vl in result["vllm"])
    counted = ", ".join(f"{vl['vllm_generation_tokens']:.0f} in {vl['dtype']}" for vl in result["vllm"])
    reused = (" (`--reuse`: the records and timings of the run before with the same arguments; this one redid the "
              "comparison)" if "--reuse" in command.split() else "")
    block = "\n".join([
        START, "", f"    {command}", "",
        f"{n} records: {result['single']} prompts from `dspark data prompts` (seed 0) and {result['two_turn']} "
        f"two-turn conversations made of {2 * result['two_turn']} further ones (half with a system message; domains "
        f"of all {result['single'] + 2 * result['two_turn']}: {result['domains']}), target {result['target']}, "
        f"greedy (`--temperature 0`), `--max-new-tokens {result['max_new_tokens']}`, measured one after the "
        f"other on the shared 2-core machine (load average before and after each: {loads}). The in-process side "
        f"runs with {result['threads']} thread; vLLM's CPU build binds its worker to one core and reserves the "
        "other. Seconds are the regeneration alone: not loading the target, not the server's start (to answer "
        f"/health with `--enforce-eager`: {starts}) nor one warm-up request. vLLM's own counter "
        f"(`vllm:generation_tokens_total`, the warm-up's 8 included) read {counted}{reused}.", "",
        *rows, "", *[line for vl in result["vllm"] for line in (_why(vl, details), "")], END])
    write_between(doc, START, END, block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=default_vllm_python(), help="(default: $VLLM_VENV/bin/python)")
    p.add_argument("--target", default="smollm2-135m", help="target preset or HF folder (vLLM reads the folder)")
    p.add_argument("--threads", type=int, default=1, help="in-process torch threads (default: %(default)s)")
    p.add_argument("--num", type=int, default=32, help="prompts (default: %(default)s)")
    p.add_argument("--multi-turn", type=int, default=8,
                   help="extra two-turn conversations made of further prompts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="in-process engine batch (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="conversations in flight to vLLM (default: %(default)s)")
    p.add_argument("--vllm-dtypes", default="float32,bfloat16",
                   help="one server run per vLLM --dtype; float32 is the in-process dtype, bfloat16 what vLLM's CPU "
                   "build picks for SmolLM2 without --dtype (default: %(default)s)")
    p.add_argument("--port", type=int, default=8777)
    p.add_argument("--wait-s", type=float, default=600, help="longest wait for the server to start")
    p.add_argument("--work", type=Path, default=Path("runs/regenerate-vllm"))
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "data-throughput.md")
    p.add_argument("--details", type=Path, default=ROOT / "docs" / "interop" / "regenerate-vllm.json",
                   help="where the per-record results go (default: %(default)s)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the prompts and the finished runs (records and timings) of an earlier run in --work")
    args = p.parse_args(argv)
    venv = f"VLLM_VENV={os.environ['VLLM_VENV']} " if os.environ.get("VLLM_VENV") else ""
    command = f"{venv}python scripts/regenerate_vllm.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    version = check_vllm(args.vllm_python)

    import torch

    from dspark.data.prompt_sources import default_sources
    from dspark.data.prompts import build_prompt_set
    from dspark.data.regenerate import regenerate
    from dspark.data.regenerate_http import regenerate_over_http
    from dspark.target.loading import load_decoding_target
    from dspark.target.convert import resolve_model_path

    torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target_dir = str(resolve_model_path(args.target))
    prompts = work / "prompts.jsonl"
    if not (args.reuse and prompts.exists()):
        prompts.unlink(missing_ok=True)
        summary = build_prompt_set(prompts, args.num + 2 * args.multi_turn, seed=0, sources=default_sources(),
                                   progress=False)
        (work / "domains.json").write_text(json.dumps(summary.written))
        add_multi_turn(prompts, args.num, args.multi_turn)
    domains = json.loads((work / "domains.json").read_text())
    greedy = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0, progress=False)

    target = load_decoding_target(args.target, "cpu", "float32")
    ip_out, ip_stats = work / "in-process.jsonl", work / "in-process.json"
    if not (args.reuse and ip_stats.exists()):
        ip_out.unlink(missing_ok=True)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        stats = regenerate(target, prompts, ip_out, batch_size=args.batch_size, **greedy)
        seconds = time.perf_counter() - t0
        ip_stats.write_text(json.dumps({"name": "in process", "batch": args.batch_size, "succeeded": stats.succeeded,
                                        "new_tokens": stats.new_tokens, "seconds": seconds,
                                        "rate": stats.new_tokens / seconds, "load_before": round(load, 1),
                                        "load_after": round(os.getloadavg()[0], 1)}))
    ip = json.loads(ip_stats.read_text())
    print(f"in process: {ip}", flush=True)
    a = records(ip_out)

    runs = []
    for dtype in args.vllm_dtypes.split(","):
        vl_out, vl_stats = work / f"vllm-{dtype}.jsonl", work / f"vllm-{dtype}.json"
        if not (args.reuse and vl_stats.exists()):
            vl_out.unlink(missing_ok=True)
            load = os.getloadavg()[0]
            with VllmServer(args.vllm_python, target_dir, args.port, dtype, work / f"vllm-server-{dtype}.log",
                            args.wait_s) as server:
                _http(server.base + "/v1/chat/completions", {"model": target_dir, "max_tokens": 8, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "Hello!"}]}, 300)
                t0 = time.perf_counter()
                stats = regenerate_over_http(server.base + "/v1", prompts, vl_out, concurrency=args.concurrency,
                                             **greedy)
                seconds = time.perf_counter() - t0
                counters = server.metrics()
            vl_stats.write_text(json.dumps({
                "name": f"vLLM {dtype}", "version": version, "dtype": dtype, "concurrency": args.concurrency,
                "succeeded": stats.succeeded, "failed": stats.failed, "new_tokens": stats.new_tokens,
                "seconds": seconds, "rate": stats.new_tokens / seconds, "ready_s": server.ready_s,
                "vllm_generation_tokens": counters.get("vllm:generation_tokens_total", float("nan")),
                "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1)}))
        vl = json.loads(vl_stats.read_text())
        b = records(vl_out)
        vl["equal"] = sum(a[k] == b.get(k) for k in a)
        differ = [k for k in a if k in b and a[k] != b[k]]
        same_dtype = None
        if differ and dtype != "float32":
            same_dtype = load_decoding_target(args.target, "cpu", dtype)
        vl["differences"] = [{"id": k, **first_difference(target, a[k], b[k], same_dtype)} for k in differ]
        vl["missing_over_http"] = sorted(set(a) - set(b))
        print(f"vLLM {dtype}: {vl}", flush=True)
        runs.append(vl)
    result = {"target": args.target, "records": len(a), "single": args.num, "two_turn": args.multi_turn,
              "domains": domains, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "in_process": ip, "vllm": runs}
    args.details.parent.mkdir(parents=True, exist_ok=True)
    args.details.write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    try:  # a link from the page
        shown = str(args.details.resolve().relative_to(args.doc.resolve().parent))
        shown = f"[{shown}]({shown})"
    except ValueError:
        shown = str(args.details)
    write_doc(args.doc, result, command, shown)
    print(f"wrote {args.doc} and {args.details}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
