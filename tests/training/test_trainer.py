"""The training loop: LR schedule, data order, checkpoints, resume, time budget, config, overfitting."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.training.config import (
    TrainConfig, TrainConfigError, build_model_config, config_from_dict, load_config, preset_names,
)
from dspark.data.features import build_feature_cache
from dspark.drafters.registry import kind_entry
from dspark.training.checkpoints import latest_checkpoint
from dspark.training.trainer import DataOrder, Trainer, lr_multiplier, train
from tests.tiny import tiny_target

TINY_DSPARK = {"block_size": 4, "num_anchors": 8, "markov_rank": 16}


def random_data(n: int, length: int = 24, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(length, dtype=torch.long)
        mask[:4] = 0  # a "prompt" that is not supervised
        out.append({"input_ids": torch.randint(2, 96, (length,), generator=g), "loss_mask": mask})
    return out


def tiny_cfg(out, **kw) -> TrainConfig:
    base = dict(drafter="dspark", out=str(out), max_steps=4, log_every=1, checkpoint_every=2, grad_accum=2,
                num_threads=1, model=dict(TINY_DSPARK))
    return TrainConfig(**{**base, **kw})


def read_metrics(out) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {d["step"]: d for d in map(json.loads, lines)}


# ---------------------------------------------------------------- schedule and order

def test_lr_schedule_warmup_then_cosine_to_zero():
    total, warmup = 100, int(0.04 * 100)
    lrs = [lr_multiplier(s, total, warmup) for s in range(total)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, (step+1)/warmup
    assert lrs[4] == 1.0  # the cosine starts at the peak
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # then only decreases
    assert lrs[4 + 48] == pytest.approx(0.5)  # half-way through the decay
    assert 0 < lrs[-1] < 1e-3 and lr_multiplier(total, total, warmup) == pytest.approx(0.0)
    assert lr_multiplier(0, 10, 0) == 1.0  # no warmup: peak from step 0


def test_data_order_disjoint_ranks_whole_epochs_and_deterministic():
    order = DataOrder(num_samples=23, world_size=2, grad_accum=3, seed=7)
    assert order.global_batch == 6 and order.steps_per_epoch == 3
    epoch0 = [i for s in range(3) for r in range(2) for i in order.indices(s, r)]
    assert len(epoch0) == len(set(epoch0)) == 18  # no sample twice within an epoch, ranks disjoint
    for s in range(3):
        assert not set(order.indices(s, 0)) & set(order.indices(s, 1))
    assert order.indices(3, 0) != order.indices(0, 0) or order.indices(3, 1) != order.indices(0, 1)  # reshuffled
    assert DataOrder(23, 2, 3, 7).indices(4, 1) == order.indices(4, 1)
    assert DataOrder(23, 2, 3, 8).permutation(0).tolist() != order.permutation(0).tolist()


# ---------------------------------------------------------------- checkpoints and resume

def test_checkpoint_layout_latest_symlink_and_summary(tmp_path):
    target, data = tiny_target(), random_data(6)
    out = tmp_path / "run"
    last = train(tiny_cfg(out), target=target, dataset=data)
    assert last == out / "step_4"
    assert {p.name for p in out.iterdir()} >= {"step_2", "step_4", "step_latest", "tb", "metrics.jsonl",
                                               "train_summary.json"}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp folders left behind
    link = out / "step_latest"
    assert link.is_symlink() and str(link.readlink()) == "step_4"  # relative: the folder can move
    for step in ("step_2", "step_4"):
        names = {p.name for p in (out / step).iterdir()}
        assert names == {"model.safetensors", "config.json", "train_config.json", "training_state.rank0.pt"}
    assert list((out / "tb").glob("events.out.tfevents.*"))
    # train_config.json works as --config again
    again = load_config(str(out / "step_4" / "train_config.json"))
    assert again.model == TINY_DSPARK and again.max_steps == 4
    # the saved drafter reloads with the trained weights
    reloaded = kind_entry("dspark").model_class.from_checkpoint(out / "step_4", target)
    fresh = kind_entry("dspark").model_class.from_target(target, build_model_config(tiny_cfg(out), target.default_layer_ids()))
    assert not torch.equal(reloaded.fc.weight, fresh.fc.weight)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped_by"] == "max_steps"
    assert summary["tokens_seen"] == 4 * 2 * 24 and summary["last_checkpoint"] == str(last)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "acc@0"} <= set(summary["final_metrics"])


class _Killed(Exception):
    pass


class _DiesAfter:
    """A dataset that 'kills' the run when step ``die_at`` asks for its first sample."""

    def __init__(self, data, die_after_reads: int) -> None:
        self.data, self.left = data, die_after_reads

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        if self.left == 0:
            raise _Killed()
        self.left -= 1
        return self.data[i]


@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_resume_after_kill_gives_the_same_next_step_loss(tmp_path, drafter):
    target, data = tiny_target(), random_data(6)
    model = TINY_DSPARK if drafter == "dspark" else {"ttt_length": 3}
    full = tmp_path / "full"
    train(tiny_cfg(full, drafter=drafter, model=model), target=target, dataset=data)

    cut = tmp_path / "cut"
    cfg = tiny_cfg(cut, drafter=drafter, model=model)
    with pytest.raises(_Killed):  # dies during step 3 (2 samples per step), after checkpoint step_2
        train(cfg, target=target, dataset=_DiesAfter(data, die_after_reads=2 * 2 + 1))
    assert latest_checkpoint(cut) == (cut / "step_2").resolve()
    with pytest.raises(Exception, match="--resume"):
        train(cfg, target=target, dataset=data)
    train(cfg, resume=True, target=target, dataset=data)

    a, b = read_metrics(full), read_metrics(cut)
    assert sorted(b) == [1, 2, 3, 4]  # lines from the killed session after step 2 were dropped
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-7)
        assert b[step]["lr"] == pytest.approx(a[step]["lr"])
    # negative control: the loss does change from step to step, so equality above is informative
    assert a[3]["loss"] != pytest.approx(a[4]["loss"], rel=1e-5)


def test_init_from_starts_from_the_checkpoint_weights_with_a_fresh_schedule(tmp_path):
    target, data = tiny_target(), random_data(6)
    first = train(tiny_cfg(tmp_path / "a", save_dtype="float32"), target=target, dataset=data)
    saved = kind_entry("dspark").model_class.from_checkpoint(first, target).state_dict()
    cfg = tiny_cfg(tmp_path / "b", init_from=str(first), max_steps=2, seed=7)
    trainer = Trainer(cfg, target=target, dataset=data)
    start = trainer.model.state_dict()
    assert trainer.step == 0 and trainer.scheduler.last_epoch == 0  # fresh optimizer and LR schedule
    assert all(torch.equal(start[k].float(), v.float()) for k, v in saved.items())
    # negative control: the same config without init_from starts elsewhere
    fresh = Trainer(tiny_cfg(tmp_path / "c", max_steps=2, seed=7), target=target, dataset=data).model.state_dict()
    assert not all(torch.equal(fresh[k].float(), v.float()) for k, v in saved.items())
    trainer.close()


def test_init_from_refuses_another_kind_or_architecture(tmp_path):
    target, data = tiny_target(), random_data(6)
    first = train(tiny_cfg(tmp_path / "a"), target=target, dataset=data)
    with pytest.raises(TrainConfigError, match="markov_rank=16 \\(config: 0\\)"):
        train(tiny_cfg(tmp_path / "b", drafter="dflash", init_from=str(first),
                       model={"block_size": 4, "num_anchors": 8}), target=target, dataset=data)
    with pytest.raises(TrainConfigError, match="block_size=4 \\(config: 5\\)"):
        train(tiny_cfg(tmp_path / "c", init_from=str(first), model={**TINY_DSPARK, "block_size": 5}),
              target=target, dataset=data)
    with pytest.raises(TrainConfigError, match="not a drafter checkpoint"):
        train(tiny_cfg(tmp_path / "d", init_from=str(tmp_path)), target=target, dataset=data)


def test_init_from_may_change_how_the_drafter_trains(tmp_path):
    target, data = tiny_target(), random_data(6)
    first = train(tiny_cfg(tmp_path / "a"), target=target, dataset=data)
    model = {**TINY_DSPARK, "num_anchors": 3, "ce_loss_alpha": 0.5}
    trainer = Trainer(tiny_cfg(tmp_path / "b", init_from=str(first), model=model), target=target, dataset=data)
    assert trainer.model.config.num_anchors == 3 and trainer.model.config.ce_loss_alpha == 0.5
    trainer.close()
    out = train(tiny_cfg(tmp_path / "c", init_from=str(first), model=model), target=target, dataset=data)
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_anchors"] == 3 and saved["ce_loss_alpha"] == 0.5
    assert json.loads((first / "config.json").read_text())["num_anchors"] == 8  # the checkpoint's own value


def test_init_from_grows_a_deeper_drafter(tmp_path):
    target, data = tiny_target(), random_data(6)
    first = train(tiny_cfg(tmp_path / "a"), target=target, dataset=data)
    grown = {**TINY_DSPARK, "num_draft_layers": 2}
    out = train(tiny_cfg(tmp_path / "b", init_from=str(first), model=grown), target=target, dataset=data)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    model = kind_entry("dspark").model_class.from_checkpoint(out, target)
    assert len(model.layers) == 2 and model.layers[1].mlp.down_proj.weight.abs().sum() > 0  # trained off zero
    with pytest.raises(TrainConfigError, match="num_draft_layers=2 \\(config: 1\\)"):  # never shrunk
        train(tiny_cfg(tmp_path / "c", init_from=str(out), model={**TINY_DSPARK, "num_draft_layers": 1}),
              target=target, dataset=data)


def test_validation_on_held_out_sequences_is_logged_and_repeatable(tmp_path):
    target, data = tiny_target(), random_data(6)
    val = build_feature_cache(target, random_data(3, seed=9), target.default_layer_ids(), tmp_path / "val",
                              progress=False)
    cfg = tiny_cfg(tmp_path / "a", val_cache_dir=str(val), val_samples=2, val_every=2)
    trainer = Trainer(cfg, target=target, dataset=data)
    first = trainer.validate()
    assert first == trainer.validate()  # the same blocks every time
    assert {"val_loss", "val_tau", "val_acc@0", "val_ce"} <= set(first)
    trainer.close()
    out = tmp_path / "b"
    train(tiny_cfg(out, val_cache_dir=str(val), val_samples=2, val_every=2), target=target, dataset=data)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_lines = {line["step"]: line for line in lines if "val_loss" in line}
    assert sorted(val_lines) == [0, 2, 4]  # before the first step, every val_every steps
    assert val_lines[0]["val_loss"] == pytest.approx(first["val_loss"], rel=1e-5)  # step 0 is the untrained model
    assert val_lines[4]["val_loss"] != pytest.approx(first["val_loss"], rel=1e-5)  # training moved it
    assert not any("val_loss" in line and "loss" in line for line in lines)  # own lines, not the training ones
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["val_metrics"]["val_loss"] == pytest.approx(val_lines[4]["val_loss"], rel=1e-5)
    # negative control: other held-out sequences give other values, so the cache is what is read
    third = Trainer(tiny_cfg(tmp_path / "c", val_cache_dir=str(val), val_samples=3), target=target, dataset=data)
    assert third.validate()["val_loss"] != pytest.approx(first["val_loss"], rel=1e-6)
    third.close()
    assert Trainer(tiny_cfg(tmp_path / "d"), target=target, dataset=data).validate() == {}
    with pytest.raises(TrainConfigError, match="val_samples must be >= 1"):
        tiny_cfg(tmp_path / "e", val_samples=0)


def test_keep_checkpoints_prunes_old_steps(tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(out, max_steps=3, checkpoint_every=1, keep_checkpoints=2), target=tiny_target(),
          dataset=random_data(6))
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_3", "step_latest"]
    assert (out / "step_latest").resolve() == (out / "step_3").resolve()


def test_time_budget_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    last = train(tiny_cfg(out, time_budget_s=0.0), target=tiny_target(), dataset=random_data(6))
    assert last == out / "step_1" and (out / "step_latest").resolve() == last.resolve()
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stopped_by"] == "time_budget" and summary["steps"] == 1


def test_too_little_data_for_one_global_batch_is_a_clear_error(tmp_path):
    with pytest.raises(TrainConfigError, match="global batch"):
        train(tiny_cfg(tmp_path / "r", grad_accum=8), target=tiny_target(), dataset=random_data(3))


# ---------------------------------------------------------------- config

def test_presets_load_open_with_their_command_and_map_onto_model_configs():
    names = preset_names()
    assert {"smollm2-dspark-markov", "smollm2-dspark-rnn", "smollm2-dflash", "smollm2-eagle3", "qwen3-8b-dspark",
            "qwen3-4b-dspark", "qwen3-14b-dspark", "qwen3-8b-dflash", "qwen3-8b-eagle3"} <= set(names)
    from importlib import resources

    for name in names:
        raw = json.loads(resources.files("dspark").joinpath("configs", f"{name}.json").read_text())
        assert next(iter(raw)) == "_command" and f"--config {name}" in raw["_command"]
        cfg = load_config(name)
        model_cfg = build_model_config(cfg, [1, 2, 3, 4, 5])
        assert getattr(model_cfg, "num_drafts", model_cfg.block_size) == 7  # drafts per step (anchor + k: 8 slots)
    q8 = load_config("qwen3-8b-dspark")
    mc = build_model_config(q8)
    assert (mc.num_draft_layers, mc.target_layer_ids, mc.mask_token_id, mc.num_anchors, mc.markov_rank) == (
        5, [1, 9, 17, 25, 33], 151669, 512, 256)
    assert (q8.lr, q8.warmup_ratio, q8.global_batch_size, q8.epochs, q8.dtype) == (6e-4, 0.04, 512, 10, "bfloat16")
    assert build_model_config(load_config("qwen3-14b-dspark")).target_layer_ids == [1, 10, 19, 28, 37]
    df = build_model_config(load_config("qwen3-8b-dflash"))
    assert (df.markov_rank, df.enable_confidence_head, df.ce_loss_alpha, df.l1_loss_alpha) == (0, False, 1.0, 0.0)


def test_overrides_dotted_keys_and_unknown_keys_are_errors():
    cfg = load_config("smollm2-dspark-markov", ["lr=1e-3", "model.num_anchors=8", "data=some/dir", "max_steps=3"])
    assert (cfg.lr, cfg.model["num_anchors"], cfg.data, cfg.max_steps) == (1e-3, 8, ["some/dir"], 3)
    assert load_config("smollm2-dspark-markov", drafter="dflash").drafter == "dflash"
    with pytest.raises(TrainConfigError, match="unknown training config key"):
        load_config("smollm2-dspark-markov", ["learning_rate=1"])
    with pytest.raises(TrainConfigError, match="unknown model config key"):
        load_config("smollm2-dspark-markov", ["model.anchors=8"])
    with pytest.raises(TrainConfigError, match="wrong type"):
        load_config("smollm2-dspark-markov", ["lr=fast"])
    with pytest.raises(TrainConfigError, match="key=value"):
        load_config("smollm2-dspark-markov", ["lr"])
    with pytest.raises(TrainConfigError, match="no such preset"):
        load_config("no-such-preset")
    with pytest.raises(TrainConfigError, match="not both"):
        config_from_dict({"grad_accum": 2, "global_batch_size": 8})
    assert TrainConfig(global_batch_size=8).grad_accum_for(2) == 4
    with pytest.raises(TrainConfigError, match="divisible"):
        TrainConfig(global_batch_size=9).grad_accum_for(2)


# ---------------------------------------------------------------- learning

def _overfit(tmp_path, lr: float) -> tuple[float, float]:
    out = tmp_path / f"lr{lr}"
    cfg = tiny_cfg(out, max_steps=150, grad_accum=1, log_every=10, checkpoint_every=1000, lr=lr, warmup_ratio=0.0,
                   model={"block_size": 4, "num_anchors": 16, "markov_rank": 16})
    train(cfg, target=tiny_target(), dataset=random_data(2))
    m = read_metrics(out)
    first = m[10]["acc@0"]
    last = sum(m[s]["acc@0"] for s in (130, 140, 150)) / 3
    return first, last


def test_overfitting_a_few_sequences_drives_acceptance_up(tmp_path):
    first, last = _overfit(tmp_path, lr=1e-2)
    assert last > first + 0.25 and last > 0.4, (first, last)
    # negative control: without learning the acceptance estimate stays where it started
    first0, last0 = _overfit(tmp_path, lr=1e-9)
    assert abs(last0 - first0) < 0.05, (first0, last0)


def test_time_budget_schedule_warms_up_and_decays_within_the_budget():
    from dspark.training.trainer import progress_multiplier

    assert progress_multiplier(0.0, 0.04) == pytest.approx(1e-3)
    assert progress_multiplier(0.02, 0.04) == pytest.approx(0.5)
    assert progress_multiplier(0.04, 0.04) == pytest.approx(1.0)
    assert progress_multiplier(0.52, 0.04) == pytest.approx(0.5)
    assert progress_multiplier(1.0, 0.04) == pytest.approx(0.0, abs=1e-12)
    assert progress_multiplier(1.7, 0.04) == pytest.approx(0.0, abs=1e-12)


def test_time_budget_run_uses_the_time_schedule(tmp_path, monkeypatch):
    import types

    from dspark.training import trainer as trainer_module

    clock = iter(range(10**9))  # a virtual clock, 10 ms per reading: the run is the same however busy the CPU is
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) * 0.01))
    out = tmp_path / "timed"
    cfg = tiny_cfg(out, max_steps=10_000, time_budget_s=3.0, log_every=1, lr=1e-3, warmup_ratio=0.04)
    train(cfg, target=tiny_target(), dataset=random_data(8))
    m = read_metrics(out)
    steps = sorted(m)
    assert len(steps) < 10_000  # stopped by the budget
    # past warmup the rate reaches the peak and then decays towards 0 by the end of the budget
    lrs = [m[s]["lr"] for s in steps]
    assert len(steps) > 20, steps
    assert max(lrs) > 0.5e-3 and lrs[-1] < 0.2e-3, lrs


def test_train_cli_drafter_choices_come_from_the_registry(capsys):
    from dspark.cli import main
    from dspark.drafters.registry import KIND_NAMES

    assert main(["train", "--config", "smollm2-dspark-markov", "--drafter", "dflash", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"] == "dflash"
    with pytest.raises(SystemExit):
        main(["train", "--config", "smollm2-dspark-markov", "--drafter", "medusa"])
    assert "{" + ",".join(KIND_NAMES) + "}" in capsys.readouterr().err
    with pytest.raises(TrainConfigError, match="drafter must be one of dspark, dflash, eagle3, draft-lm"):
        TrainConfig(drafter="medusa")


def test_threads_flag_wins_over_the_configs_num_threads(tmp_path, monkeypatch):
    """`dspark --threads 1 train` trains with 1 thread even when the config says 2."""
    import dspark.training.trainer as trainer_module
    from dspark.cli import main

    seen = []
    real_train, real_step = trainer_module.train, trainer_module.Trainer.train_step
    monkeypatch.setattr(trainer_module, "train", lambda cfg, **kw: real_train(
        cfg, target=tiny_target(), dataset=random_data(2), **kw))  # the CLI path, with the tiny target and data
    monkeypatch.setattr(trainer_module.Trainer, "train_step",
                        lambda self, *a: (seen.append(torch.get_num_threads()), real_step(self, *a))[1])
    monkeypatch.delenv("DSPARK_THREADS", raising=False)
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"drafter": "dspark", "max_steps": 1, "grad_accum": 2, "num_threads": 2,
                                  "model": TINY_DSPARK}))
    before = torch.get_num_threads()
    try:
        assert main(["--threads", "1", "train", "--config", str(config), "--out", str(tmp_path / "a")]) == 0
        assert main(["train", "--config", str(config), "--out", str(tmp_path / "b")]) == 0  # negative control
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
    assert json.loads((tmp_path / "a" / "step_1" / "train_config.json").read_text())["num_threads"] == 1


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path, capsys):
    from dspark.training.config import TrainConfigError

    target, data = tiny_target(), random_data(6)
    out = tmp_path / "run"
    train(tiny_cfg(out, max_steps=2), target=target, dataset=data)
    with pytest.raises(TrainConfigError, match=r"lr: 0.0006 there, 0.001 now.*--init-from"):
        train(tiny_cfg(out, max_steps=2, lr=1e-3), resume=True, target=target, dataset=data)
    with pytest.raises(TrainConfigError, match=r"seed: 42 there, 7 now"):
        train(tiny_cfg(out, max_steps=2, seed=7), resume=True, target=target, dataset=data)
    with pytest.raises(TrainConfigError, match=r"model:"):
        train(tiny_cfg(out, max_steps=2, model={**TINY_DSPARK, "num_anchors": 3}), resume=True, target=target,
              dataset=data)
    # how long a sitting lasts, threads and checkpointing may change: the same run goes on
    assert train(tiny_cfg(out, max_steps=2, session_time_s=100.0, checkpoint_every=1, num_threads=2), resume=True,
                 target=target, dataset=data) == out / "step_2"
    assert "another run length" not in capsys.readouterr().out
    # a longer run goes on, and says that the schedule follows the new length
    assert train(tiny_cfg(out, max_steps=3), resume=True, target=target, dataset=data) == out / "step_3"
    assert "another run length (max_steps 2 -> 3)" in capsys.readouterr().out


def test_session_time_stops_with_a_checkpoint_and_the_resume_keeps_the_step_schedule(tmp_path):
    target, data = tiny_target(), random_data(6)
    full = tmp_path / "full"
    train(tiny_cfg(full, max_steps=4), target=target, dataset=data)
    cut = tmp_path / "cut"
    first = train(tiny_cfg(cut, max_steps=4, session_time_s=0.0), target=target, dataset=data)
    assert first == cut / "step_1"  # stopped after the first step, with a checkpoint
    assert json.loads((cut / "train_summary.json").read_text())["stopped_by"] == "session_time"
    assert train(tiny_cfg(cut, max_steps=4), resume=True, target=target, dataset=data) == cut / "step_4"
    a, b = read_metrics(full), read_metrics(cut)
    for step in (2, 3, 4):  # the schedule is the step count's, as if never stopped
        assert b[step]["lr"] == pytest.approx(a[step]["lr"])
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-7)
