"""The printed launch command names the exported drafter by its absolute path, so it works from any directory.

(Issue 24 item 3(c) runs the printed commands against vLLM's CPU build: scripts/vllm_launch_check.py,
docs/interop.md §Checked in vLLM.)
"""

from __future__ import annotations

import json
import shlex

from dspark.export.engines import export_for_engine
from tests.drafters.tiny_drafters import tiny_dflash, tiny_dspark
from tests.tiny import tiny_target


def test_the_printed_commands_name_the_export_by_its_absolute_path(tmp_path, monkeypatch):
    qwen3 = tiny_target(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    tiny_dflash(tiny_target(), slot_offset=1, draft_layer="qwen3").save_checkpoint("dflash")
    tiny_dspark(qwen3).save_checkpoint("dspark")

    _, vllm = export_for_engine("dflash", "vllm", "out/dflash-vllm", target="HuggingFaceTB/SmolLM2-135M-Instruct")
    argv = shlex.split(vllm)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["model"] == str((tmp_path / "run" / "out" / "dflash-vllm").resolve())
    assert (tmp_path / "run" / "out" / "dflash-vllm" / "config.json").is_file()

    _, sglang = export_for_engine("dspark", "sglang", "out/dspark-sglang", target="Qwen/Qwen3-8B")
    argv = shlex.split(sglang)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str((tmp_path / "run" / "out" / "dspark-sglang")
                                                                         .resolve())
