"""Bad input at every entry point a user touches raises an autopar error that says what was expected, what was
found and what to do: cluster figures, constraints, precision, plans handed to compile that are of another
cluster, model or batch, inputs at train_step / eval_step that differ from the planned ones, and checkpoint
directories that are not (or no longer) loadable. One-rank programs: no process group beyond this process."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import autopar
from autopar.checkpoint.training import MARKER
from autopar.cluster import MAX_DEVICES, ClusterSpec
from tests.models import make_batch, make_model


@pytest.fixture(scope="module")
def llama():
    args, kwargs = make_batch("llama")
    pm = autopar.compile(make_model("llama"), "cpu:1", args, kwargs)
    return pm, args, kwargs


# ------------------------------------------------------------------------------------------- clusters


@pytest.mark.parametrize("value", [".inf", "1e999", ".nan"])
def test_cluster_file_figures_must_be_finite(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"cluster: cpu:2\nhost_memory_bytes: {value}\n")
    with pytest.raises(autopar.ConfigError, match="host_memory_bytes.*finite"):
        ClusterSpec.from_file(path)


def test_cluster_past_the_device_cap_is_refused():
    with pytest.raises(autopar.ConfigError, match="check the node and device counts"):
        ClusterSpec.parse(f"2x{MAX_DEVICES}xA100-80GB")


def test_cluster_dict_with_a_value_of_the_wrong_kind_is_a_config_error():
    d = ClusterSpec.parse("cpu:2").to_dict()
    d["num_nodes"] = "two"
    with pytest.raises(autopar.ConfigError, match="whole number"):
        ClusterSpec.from_dict(d)


@pytest.mark.integration
def test_plan_takes_a_cluster_file_path(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster: cpu:2\n")
    plan = autopar.plan("tiny-llama", str(path), global_batch_size=2, seq_len=8, alternatives=False)
    assert plan.cluster.world_size == 2


# ------------------------------------------------------------------------------ constraints and options


@pytest.mark.parametrize(
    ("constraints", "words"),
    [
        ({"tp": True}, "constraints\\['tp'\\]=True: expected a positive integer"),
        ({"dp": 1.0}, "constraints\\['dp'\\]=1.0: expected a positive integer"),
        ({"pp": "2"}, "constraints\\['pp'\\]='2': expected a positive integer"),
        ({"zero": True}, "constraints\\['zero'\\]=True: expected 0, 1, 2 or 3"),
        ({"overlap": "yes"}, "constraints\\['overlap'\\]='yes': expected True or False"),
        ({"prefetch_depth": -1}, "constraints\\['prefetch_depth'\\]=-1: expected a count of layers"),
        ({"prefetch_depth": True}, "constraints\\['prefetch_depth'\\]=True: expected a count of layers"),
        ({"schedule": 1}, "constraints\\['schedule'\\]=1: expected a name"),
        ({"tp_min_split": "all"}, "expected a fraction"),
        ([("tp", 2)], "constraints must be a dict"),
    ],
)
def test_constraints_of_the_wrong_kind_are_named(constraints, words):
    with pytest.raises(autopar.ConfigError, match=words):
        autopar.plan("tiny-llama", "cpu:2", global_batch_size=2, seq_len=8, constraints=constraints)


def test_unknown_precision_is_a_config_error():
    with pytest.raises(autopar.ConfigError, match="precision='int8': expected one of bf16, fp16, fp32"):
        autopar.plan("tiny-llama", "cpu:2", global_batch_size=2, seq_len=8, precision="int8")


# --------------------------------------------------------------------------------- plans given to compile


@pytest.fixture(scope="module")
def llama_plan():
    args, kwargs = make_batch("llama")
    return autopar.plan(make_model("llama"), "cpu:1", args, kwargs, alternatives=False)


@pytest.mark.integration
def test_compile_refuses_a_plan_of_another_cluster(llama_plan):
    other = autopar.Plan.from_json(llama_plan.to_json().replace('"name": "cpu"', '"name": "cpu-b"'))
    with pytest.raises(autopar.ConfigError, match="the plan is for 1 node x 1 cpu-b .* but compile was given"):
        autopar.compile(make_model("llama"), "cpu:1", *make_batch("llama"), plan=other)


@pytest.mark.integration
def test_compile_refuses_a_plan_of_another_model(llama_plan):
    with pytest.raises(autopar.ConfigError, match="trainable parameters but this model .GPT2LMHeadModel. has"):
        autopar.compile(make_model("gpt2"), "cpu:1", *make_batch("gpt2"), plan=llama_plan)


@pytest.mark.integration
def test_compile_refuses_a_plan_of_another_sequence_length(llama_plan):
    with pytest.raises(autopar.ConfigError, match="128 tokens per step but the example inputs hold 64"):
        autopar.compile(make_model("llama"), "cpu:1", *make_batch("llama", seq=8), plan=llama_plan)


@pytest.mark.parametrize(
    ("kw", "words"),
    [({"plan": "plan.json"}, "plan= must be an autopar.Plan"), ({"optimizer": 0.1}, "optimizer must be a callable")],
)
def test_compile_refuses_arguments_of_the_wrong_kind(kw, words):
    with pytest.raises(autopar.ConfigError, match=words):
        autopar.compile(make_model("llama"), "cpu:1", *make_batch("llama"), **kw)


# ------------------------------------------------------------------------------------- train_step inputs


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t], dim=1)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("change", "words"),
    [
        # a shorter sequence runs on the plan (`runtime.shapes`); a longer one is refused
        (lambda a, k: ((_doubled(a[0]),), {"labels": _doubled(k["labels"])}), "32 tokens, longer than the 16"),
        (lambda a, k: ((a[0].int(),), k), "args\\[0\\] has shape \\(8, 16\\) and dtype torch.int32"),
        (lambda a, k: (a, {"labels": k["labels"].float()}), "labels has shape .* dtype torch.float32"),
        (lambda a, k: ((a[0][:4],), {"labels": k["labels"][:4]}), "args\\[0\\] has shape \\(4, 16\\)"),
        (
            lambda a, k: (a, {}),
            "given the inputs \\(args\\[0\\]\\) but the program was compiled for \\(args\\[0\\], labels\\)",
        ),
        (lambda a, k: (a, {**k, "attention_mask": torch.ones_like(a[0])}), "attention_mask"),
    ],
)
def test_inputs_unlike_the_planned_ones_are_named(llama, change, words):
    pm, args, kwargs = llama
    bad_args, bad_kwargs = change(args, kwargs)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    for step in (pm.train_step, pm.eval_step):
        with pytest.raises(autopar.ConfigError, match=words):
            step(*bad_args, **bad_kwargs)
    assert all(torch.equal(before[k], v) for k, v in pm.state_dict().items()), "a refused step changed the model"
    assert pm.num_steps == 0


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    pm, _, _ = llama
    root = tmp_path_factory.mktemp("ckpt")
    pm.save_checkpoint(root / "good", extra={"data_position": 7})
    return root / "good"


@pytest.mark.integration
def test_load_of_none_says_that_latest_checkpoint_found_none(llama, tmp_path):
    pm, _, _ = llama
    with pytest.raises(autopar.ConfigError, match="latest_checkpoint found none"):
        pm.load_checkpoint(autopar.latest_checkpoint(tmp_path))


@pytest.mark.integration
def test_checkpoint_of_another_version_is_skipped_and_refused_with_both_versions(llama, saved, tmp_path):
    pm, _, _ = llama
    shutil.copytree(saved, tmp_path / "old")
    shutil.copytree(saved, tmp_path / "new")
    marker = json.loads((tmp_path / "new" / MARKER).read_text())
    (tmp_path / "new" / MARKER).write_text(json.dumps(marker | {"version": 3, "step": marker["step"] + 5}))
    assert autopar.latest_checkpoint(tmp_path) == str(tmp_path / "old")
    with pytest.raises(autopar.ConfigError, match="format version 3; this autopar reads version 2"):
        pm.load_checkpoint(tmp_path / "new")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "words"),
    [(".metadata", "missing or damaged index"), ("__0_0.distcp", "shard files are missing or damaged")],
)
def test_checkpoint_with_a_missing_file_is_a_config_error(llama, saved, tmp_path, name, words):
    pm, _, _ = llama
    shutil.copytree(saved, tmp_path / "ckpt")
    (tmp_path / "ckpt" / name).unlink()
    with pytest.raises(autopar.ConfigError, match=words):
        pm.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.integration
def test_checkpoint_of_another_model_is_refused(saved):
    other = autopar.compile(make_model("gpt2"), "cpu:1", *make_batch("gpt2"))
    with pytest.raises(autopar.ConfigError, match="it is of another model"):
        other.load_checkpoint(saved)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"keep_last": "2"}, "keep_last must be a whole number"),
        ({"extra": {"f": lambda: 0}}, r"extra\['f'\] is a .*function; a checkpoint stores plain data only"),
        ({"extra": [1]}, "extra must be a dict"),
        ({"async_save": "yes"}, "async_save must be True or False"),
    ],
)
def test_save_refuses_bad_arguments_before_writing(llama, tmp_path, kw, words):
    pm, _, _ = llama
    with pytest.raises(autopar.ConfigError, match=words):
        pm.save_checkpoint(tmp_path / "ckpt", **kw)
    assert not any(tmp_path.iterdir()), "a refused save left files behind"


@pytest.mark.integration
def test_checkpoint_saved_before_the_first_step_loads_into_a_trained_program(tmp_path):
    """Before its first step a torch optimizer holds no states, so such a checkpoint has none: loading it gives
    the saved weights and an optimizer that starts afresh, and the next step equals the saving program's."""
    args, kwargs = make_batch("llama")
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731 - momentum shows stale states
    saving = autopar.compile(make_model("llama"), "cpu:1", args, kwargs, optimizer=sgd)
    saving.save_checkpoint(tmp_path / "step0")
    loading = autopar.compile(make_model("llama", seed=1), "cpu:1", args, kwargs, optimizer=sgd)
    loading.train_step(*args, **kwargs)
    loading.load_checkpoint(tmp_path / "step0")
    assert loading.num_steps == 0 and not loading.optimizer.state
    for _ in range(2):  # same program, same operations: the same bits
        assert loading.train_step(*args, **kwargs) == saving.train_step(*args, **kwargs)
