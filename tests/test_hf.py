"""``ckptstage.hf.CkptstageCallback`` under a real ``transformers.Trainer`` (CPU, tiny GPT-2) and a real daemon."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from support import assert_same
from ckptstage.client import CheckpointNotFound, Client  # noqa: E402
from ckptstage.hf import CkptstageCallback, steps_to_rotate  # noqa: E402

STEPS_PER_EPOCH = 3  # 12 samples, batches of 4


def tiny_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)  # the Trainer seeds only after the model exists
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


class Record(TrainerCallback):
    """Each step's training loss as logged, and the model's weights at chosen steps."""

    def __init__(self, weights_at: tuple[int, ...] = ()) -> None:
        self.losses: dict[int, float] = {}
        self.weights_at = weights_at
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step in self.weights_at:
            self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):
    """Ends the run the hard way, as a killed job would, once ``step`` is done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise Crash(f"crash after step {self.step}")


def trainer(out: Path, model_seed: int, callbacks: list[Any], **args: Any) -> Trainer:
    settings: dict[str, Any] = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=1,
                                    learning_rate=1e-3, seed=7, use_cpu=True, report_to=[], disable_tqdm=True,
                                    dataloader_num_workers=0, save_strategy="steps")
    compute_metrics = args.pop("compute_metrics", None)
    settings.update(args)
    return Trainer(model=tiny_model(model_seed), args=TrainingArguments(str(out), **settings),
                   train_dataset=samples(12), eval_dataset=samples(4, seed=1), callbacks=callbacks,
                   compute_metrics=compute_metrics)


def steps_on(client: Client) -> dict[int, bool]:
    """The job's steps on the daemon, each with whether it is pinned."""
    return {c.step: c.pinned for c in client.list()}


# --- resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, every, crash_at", [
    ("steps", 4, 5),    # resumes mid-epoch: the Trainer skips one batch, then restores the RNG states
    ("steps", 3, 4),    # resumes at an epoch boundary: the RNG states are restored before the shuffle
    ("epoch", None, 7),  # saves from on_epoch_end; the last one is taken at on_train_end
])
def test_resumed_run_continues_bit_identically(daemon, tmp_path, strategy, every, crash_at):
    total = 12
    save_args: dict[str, Any] = {"save_strategy": strategy, **({"save_steps": every} if every else {})}
    saved_at = crash_at - 1 if strategy == "steps" else (crash_at - 1) // STEPS_PER_EPOCH * STEPS_PER_EPOCH
    straight = Record(weights_at=(total,))
    trainer(tmp_path / "straight", 0, [straight], max_steps=total, save_strategy="no").train()

    first = Record()
    ckpt = CkptstageCallback("hf-resume", socket=daemon.socket)
    with pytest.raises(Crash):
        trainer(tmp_path / "run", 0, [first, CrashAt(crash_at), ckpt], max_steps=total, **save_args).train()
    ckpt.close()
    with Client("hf-resume", socket=daemon.socket) as client:
        client.wait_step(saved_at, "local", timeout=60)  # the daemon commits the snapshot it holds
    # Saving drew no random numbers and changed nothing: the first steps are the straight run's.
    assert first.losses == {s: straight.losses[s] for s in range(1, crash_at)}
    assert not list((tmp_path / "run").glob("checkpoint-*")), "the Trainer wrote a checkpoint of its own"

    second = Record(weights_at=(total,))
    ckpt2 = CkptstageCallback("hf-resume", socket=daemon.socket)
    resumed = trainer(tmp_path / "run", 99, [second, ckpt2], max_steps=total, **save_args)  # other initial weights
    directory = ckpt2.resume()
    assert directory is not None
    resumed.train(resume_from_checkpoint=directory)

    assert min(second.losses) == saved_at + 1
    assert second.losses == {s: straight.losses[s] for s in range(saved_at + 1, total + 1)}  # ==, bit for bit
    for name, value in straight.weights[total].items():
        assert torch.equal(second.weights[total][name], value), name
    assert not Path(directory).exists(), "the directory resume() wrote outlived the resumed training"
    assert not list((tmp_path / "run").glob("checkpoint-*"))

    with Client("hf-resume", socket=daemon.socket) as client:
        final = client.load(total)
    saved_state = json.loads(final["trainer_state"].numpy().tobytes())
    assert saved_state["global_step"] == total
    # The summary train() logs after the last save point is not part of that checkpoint.
    assert saved_state["log_history"] == json.loads(json.dumps(resumed.state.log_history[:-1]))
    ckpt2.close()


def test_resume_of_a_job_without_checkpoints_starts_fresh(daemon, tmp_path):
    ckpt = CkptstageCallback("hf-fresh", socket=daemon.socket)
    t = trainer(tmp_path / "out", 0, [ckpt], max_steps=2, save_steps=2)
    assert ckpt.resume() is None
    with pytest.raises(CheckpointNotFound, match="hf-fresh"):
        ckpt.resume(required=True)
    t.train(resume_from_checkpoint=ckpt.resume())
    assert t.state.global_step == 2
    with pytest.raises(CheckpointNotFound):
        ckpt.resume(step=7)  # the job has step 2 only
    ckpt.close()


def test_train_without_the_directory_resume_returned_is_refused(daemon, tmp_path):
    ckpt = CkptstageCallback("hf-misuse", socket=daemon.socket)
    trainer(tmp_path / "a", 0, [ckpt], max_steps=2, save_steps=2).train()  # waits for its last commit
    ckpt.close()
    ckpt2 = CkptstageCallback("hf-misuse", socket=daemon.socket)
    t = trainer(tmp_path / "b", 0, [ckpt2], max_steps=4, save_steps=2)
    directory = ckpt2.resume()
    with pytest.raises(RuntimeError, match="resume_from_checkpoint"):
        t.train()  # forgot to pass it: the optimizer would silently start over
    ckpt2.close()
    assert not Path(directory).exists()


def noisy_collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Hides a random quarter of the labels: fetching a batch draws from torch's RNG."""
    ids = torch.stack([f["input_ids"] for f in features])
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.25, -100)
    return {"input_ids": ids, "labels": labels}


def test_checkpoint_holds_what_the_trainers_own_would(daemon, tmp_path):
    """Step by step, what the callback saves equals the checkpoint-N directory the Trainer writes alone.

    The save points are after an evaluation (which draws random numbers), a
    plateau scheduler steps after it, and the collator draws random numbers
    after the save point: the state taken at the next event must still be
    the Trainer's, RNG states included.
    """
    # Six batches an epoch; accelerate's loader fetches one batch ahead, so the fetch after step 2's save
    # point collates batch 4.
    args: dict[str, Any] = dict(max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
                                per_device_train_batch_size=2, metric_for_best_model="loss",
                                lr_scheduler_type="reduce_lr_on_plateau")
    own = trainer(tmp_path / "own", 0, [], **args)
    own.data_collator = noisy_collate
    own.train()
    ckpt = CkptstageCallback("hf-same", socket=daemon.socket)
    ours = trainer(tmp_path / "ours", 0, [ckpt], **args)
    ours.data_collator = noisy_collate
    ours.train()
    ckpt.close()

    with Client("hf-same", socket=daemon.socket) as client:
        for step in (2, 4):
            theirs, mine = tmp_path / "own" / f"checkpoint-{step}", client.load(step)
            weights = safetensors_load(theirs / "model.safetensors")
            assert weights and all(torch.equal(mine["model"][k], v) for k, v in weights.items())
            assert_same(mine["optimizer"], torch.load(theirs / "optimizer.pt", weights_only=True))
            assert_same(mine["scheduler"], torch.load(theirs / "scheduler.pt", weights_only=True))
            rng = torch.load(theirs / "rng_state.pth", weights_only=False)
            assert_same(mine["rng"], [rng])
            state = untimed(json.loads((theirs / "trainer_state.json").read_text()))
            state["best_model_checkpoint"] = None  # a directory there; ckptstage keeps the step ("best_step")
            assert untimed(json.loads(mine["trainer_state"].numpy().tobytes())) == state
            assert mine["best_step"] == state["best_global_step"]


def untimed(state: dict[str, Any]) -> dict[str, Any]:
    """A trainer state without the log's wall-clock figures (eval_runtime, ..._per_second)."""
    state["log_history"] = [{k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))}
                            for entry in state["log_history"]]
    return state


def safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)




# --- rotation and the best checkpoint ----------------------------------------------------


def test_save_total_limit_keeps_the_newest_steps(daemon, tmp_path):
    ckpt = CkptstageCallback("hf-limit", socket=daemon.socket)
    trainer(tmp_path / "out", 0, [ckpt], max_steps=10, save_steps=2, save_total_limit=2).train()
    with Client("hf-limit", socket=daemon.socket) as client:
        assert steps_on(client) == {8: False, 10: False}
    ckpt.close()


def test_save_total_limit_keeps_the_best_step_unpinned_without_load_best(daemon, tmp_path):
    scores = iter([1.0, 3.0, 2.0, 0.0, 1.0])  # evaluations at steps 2, 4, 6, 8, 10: the best is step 4
    ckpt = CkptstageCallback("hf-metric", socket=daemon.socket)
    trainer(tmp_path / "out", 0, [ckpt], max_steps=10, save_steps=2, eval_strategy="steps", eval_steps=2,
            save_total_limit=2, metric_for_best_model="score", greater_is_better=True,
            compute_metrics=lambda _: {"score": next(scores)}).train()
    with Client("hf-metric", socket=daemon.socket) as client:
        assert steps_on(client) == {4: False, 10: False}  # as the Trainer keeps its best directory
    ckpt.close()


def test_best_checkpoint_is_pinned_kept_and_loaded_at_the_end(daemon, tmp_path):
    scores = iter([1.0, 3.0, 2.0, 5.0, 1.0])  # one per evaluation: steps 2, 4, 6, 8, 10; best at 4, then at 8
    record = Record(weights_at=(8, 10))
    ckpt = CkptstageCallback("hf-best", socket=daemon.socket)
    seen: list[dict[int, bool]] = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step in (5, 7):  # after the saves of steps 4 and 6 were taken
                with Client("hf-best", socket=daemon.socket) as c:
                    seen.append(steps_on(c))

    t = trainer(tmp_path / "out", 0, [record, ckpt, Watch()], max_steps=10, save_steps=2, eval_strategy="steps",
                eval_steps=2, save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="score",
                greater_is_better=True, compute_metrics=lambda _: {"score": next(scores)})
    t.train()

    assert t.state.best_global_step == 8 and ckpt.best_step == 8
    with Client("hf-best", socket=daemon.socket) as client:
        # Steps 2 and 6 rotated out; 4 was pinned while it was the best, and unpinned and rotated after.
        assert seen[1][4] is True
        assert steps_on(client) == {8: True, 10: False}
        best = client.load(8)
        assert best["best_step"] == 8
        assert next(c for c in client.list() if c.step == 8).metrics["eval_score"] == 5.0
    final = t.model.state_dict()
    for name, value in record.weights[8].items():
        assert torch.equal(final[name], value), name
        assert torch.equal(best["model"][name], value), name
    assert not all(torch.equal(final[n], v) for n, v in record.weights[10].items())
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    ckpt.close()


def test_save_strategy_best_is_refused(daemon, tmp_path):
    ckpt = CkptstageCallback("hf-refused", socket=daemon.socket)
    t = trainer(tmp_path / "out", 0, [ckpt], max_steps=2, save_strategy="best", eval_strategy="steps",
                eval_steps=1, metric_for_best_model="loss")
    with pytest.raises(ValueError, match="save_strategy='best'"):
        t.train()
    ckpt.close()


# --- DDP (torchrun, two processes, gloo on CPU) -------------------------------------------


def test_ddp_main_process_saves_and_every_process_resumes(daemon, tmp_path):
    results = torchrun(tmp_path, daemon.socket)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["rng"] != results[1]["rng"]  # the processes' random streams differ: each needs its own back
    for r in results:
        full, resumed = r["full"], r["resumed"]
        assert resumed["losses"] == {s: full["losses"][s] for s in ("5", "6", "7", "8")}
        assert resumed["digest"] == full["digest"] == results[0]["full"]["digest"]
        assert r["directory_left"] is False
    with Client("hf-ddp", socket=daemon.socket) as client:
        client.wait_step(8, "local", timeout=60)
        steps = {c.step: c for c in client.list()}
    assert set(steps) == {4, 8} and all(c.world_size == 1 and c.complete for c in steps.values())
    assert steps[8].created > results[0]["created_8"]  # the resumed run replaced step 8 (overwrite)


def torchrun(out: Path, socket: Path) -> list[dict[str, Any]]:
    """Runs this file's ``ddp_rank`` on two processes; returns each one's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, str(out), str(socket)], env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("result-*.json"))]


def ddp_rank(out: str, socket: str) -> None:
    """One process of the DDP test: 8 steps saving steps 4 and 8, then a new Trainer resumed from step 4."""

    class Diverge(TrainerCallback):
        rng = ""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.rand(1 + 5 * args.process_index)  # each process's own random stream from here on
            self.rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()

    def run(model_seed: int, resume_step: int | None) -> dict[str, Any]:
        record, ckpt = Record(), CkptstageCallback("hf-ddp", socket=socket)
        t = trainer(Path(out) / str(model_seed), model_seed, [diverge, record, ckpt], max_steps=8, save_steps=4,
                    per_device_train_batch_size=2, ddp_backend="gloo")
        directory = ckpt.resume(step=resume_step) if resume_step else None
        t.train(resume_from_checkpoint=directory)
        ckpt.close()
        weights = hashlib.sha256()
        assert t.model is not None
        for name, value in sorted(t.model.state_dict().items()):
            weights.update(name.encode() + value.numpy().tobytes())
        result["rank"] = t.args.process_index
        result["directory_left"] = Path(directory).exists() if directory else None
        return {"losses": record.losses, "digest": weights.hexdigest()}

    diverge, result = Diverge(), dict[str, Any]()
    result["full"] = run(0, None)
    result["rng"] = diverge.rng
    with Client("hf-ddp", socket=socket, world_size=1) as client:
        client.wait_step(8, "local", timeout=60)
        result["created_8"] = next(c.created for c in client.list() if c.step == 8)
    result["resumed"] = run(99, 4)  # other initial weights
    (Path(out) / f"result-{result['rank']}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("steps, limit, protected, removed", [
    ([2, 4, 6], None, {6}, []),
    ([2, 4, 6], 0, {6}, []),
    ([2, 4, 6], 3, {6}, []),
    ([2, 4, 6], 2, {6}, [2]),
    ([2, 4, 6, 8], 2, {8}, [2, 4]),
    ([2, 4, 6, 8], 2, {8, 2}, [4, 6]),        # the best is kept however old
    ([2, 4, 6, 8], 1, {8, 2}, [4, 6]),        # protected steps alone exceed the limit
    ([2, 4, 6, 8], 2, {8, 6, 2}, [4]),        # the newest committed step is held while 8 is in flight
    ([6, 2, 4], 1, {6}, [2, 4]),              # oldest first, whatever order the daemon lists them in
])
def test_steps_to_rotate(steps, limit, protected, removed):
    assert steps_to_rotate(steps, limit, protected) == removed


if __name__ == "__main__":  # a process of test_ddp_main_process_saves_and_every_process_resumes, under torchrun
    ddp_rank(*sys.argv[1:])


class SignalAt(TrainerCallback):
    """Sends this process ``sig`` as training step ``step`` begins (a node given notice mid-step)."""

    def __init__(self, step: int, sig: int = signal.SIGTERM) -> None:
        self.step, self.sig = step, sig

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("on", [True, False])
def test_a_signal_saves_the_step_it_came_in_then_the_trainers_handler_runs(daemon, tmp_path, on):
    """SIGTERM during step 2 of a run saving every 100 steps: step 2 is saved, then the handler installed
    before train() runs (here it returns, so training goes on); with preemption_signals=() nothing is saved."""
    client = Client("hf-preempt", socket=daemon.socket)
    calls: list[tuple[int, int | None]] = []

    def own(signum: int, frame: Any) -> None:
        last = ckpt._last  # the callback's newest save: snapshotted by the time the handler runs?
        calls.append((signum, last.step if last is not None and last.snapshot_done() else None))

    before = signal.signal(signal.SIGTERM, own)
    try:
        ckpt = CkptstageCallback("hf-preempt", socket=daemon.socket, **({} if on else {"preemption_signals": ()}))
        record = Record(weights_at=(2,))
        trainer(tmp_path / "out", 0, [record, SignalAt(2), ckpt], max_steps=4, save_steps=100).train()
        assert signal.getsignal(signal.SIGTERM) is own  # restored at the end of training
    finally:
        signal.signal(signal.SIGTERM, before)
    ckpt.close()
    with client:
        if on:
            assert calls == [(signal.SIGTERM, 2)], calls
            assert_same(client.load(2)["model"], record.weights[2], exact_dicts=False)
            assert [c.step for c in client.list()] == [2, 4]  # and the Trainer's save at the end
        else:
            assert calls == [(signal.SIGTERM, None)]  # ran at once, nothing saved
            assert [c.step for c in client.list()] == [4]
