"""TorchTitan's tensor parallelism inside the stages, with the Piper engine running the pipeline.

In process (fast): the drop-in names, the refusals by flag (a degree that does not divide the
heads or the sequence, degrees that do not make the world size, TP with Piper's ZeRO or with
expert parallelism), and the order of the plan's copies (data replica, TP coordinate).

End to end (slow, 4 forked gloo ranks, pipeline 2 x tensor_parallel_degree 2, sequence parallel
on): TorchTitan's own engine and Piper's on the same config, seed and data; every parameter and
gradient equal per step, whole and as each process's local shard by name; a DCP checkpoint the
Piper run saved resumes under TorchTitan's engine at the same TP with the same losses. The other
schedule and model cells: ``python -m benchmarks.tp_parity`` (benchmarks/results/tp_parity.md).
"""
import shutil
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan")

from piper_plugin.adapters.torchtitan import config_registry, state_differences  # noqa: E402
from piper_plugin.adapters.torchtitan.config_names import tp_drop_in, unknown  # noqa: E402
from piper_plugin.adapters.torchtitan.flags import FlagError  # noqa: E402
from piper_plugin.adapters.torchtitan.tensor_parallel import (  # noqa: E402
    check_tensor_parallel, check_tensor_parallel_config, check_world_size,
)


def test_tensor_parallel_drop_ins_are_reachable_by_name():
    assert tp_drop_in("llama3_debugmodel_pp2_tp2_1f1b") == ("llama3_debugmodel", "1f1b")
    assert unknown("deepseek_v3_debugmodel_pp2_tp2_dualpipev") == ""
    config = config_registry.llama3_debugmodel_pp2_tp2_interleaved()
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree, par.pipeline_engine) == (2, 2, "piper")
    assert par.pipeline_parallel_schedule == "Interleaved1F1B"
    check_world_size(config, 4)
    check_tensor_parallel_config(config)


def test_a_degree_that_does_not_divide_the_heads_or_the_sequence_is_refused_by_its_flag():
    config = config_registry.llama3_debugmodel_pp2_tp2_1f1b()
    config.parallelism.tensor_parallel_degree = 3
    with pytest.raises(FlagError, match=r"--parallelism.tensor_parallel_degree 3 does not divide the model's \d+ "
                                        r"attention heads.*one of \[1, 2"):
        check_tensor_parallel_config(config)
    config.parallelism.tensor_parallel_degree = 2
    config.training.seq_len = 63
    with pytest.raises(FlagError, match=r"sequence parallelism does not divide --training.seq_len 63"):
        check_tensor_parallel_config(config)
    config.parallelism.enable_sequence_parallel = False
    check_tensor_parallel_config(config)  # without sequence parallelism any length


def test_degrees_that_do_not_make_the_world_size_are_refused():
    config = config_registry.llama3_debugmodel_pp2_tp2_1f1b()
    config.parallelism.data_parallel_shard_degree = -1
    check_world_size(config, 8)  # the rest: 2 shards
    with pytest.raises(FlagError, match=r"pipeline_parallel 2 x tensor_parallel 2 make 4 ranks but the job has 6"):
        check_world_size(config, 6)
    config.parallelism.data_parallel_shard_degree = 2
    with pytest.raises(FlagError, match=r"x data_parallel_shard 2 make 8 ranks but the job has 4"):
        check_world_size(config, 4)


def test_combinations_the_engine_does_not_run_with_tp_are_refused_by_flag():
    check_tensor_parallel(2, None, 1)
    with pytest.raises(FlagError, match=r"tensor_parallel_degree 2 with --parallelism.data_parallel_shard_degree"):
        check_tensor_parallel(2, 2, 1)
    with pytest.raises(FlagError, match=r"tensor_parallel_degree 2 with --parallelism.expert_parallel_degree 2"):
        check_tensor_parallel(2, None, 2)


def test_the_plan_copies_are_ordered_data_replica_then_tp_coordinate(monkeypatch):
    """TorchTitan's mesh (pp, dp_replicate, tp): each copy of the plan lists its processes by
    pipeline rank; copy index = replica x tp + TP coordinate (what DistComm's TP grouping reads)."""
    import torch.distributed as dist

    from piper_plugin.adapters.torchtitan import tensor_parallel

    pp, dpr, tp = 2, 2, 2
    coords = [(r // tp % dpr, r % tp, r // (dpr * tp)) for r in range(pp * dpr * tp)]

    def gather(out, _mine):
        out[:] = coords

    monkeypatch.setattr(dist, "get_world_size", lambda: len(coords))
    monkeypatch.setattr(dist, "all_gather_object", gather)
    mesh = SimpleNamespace(get_local_rank=lambda: 0)
    dims = SimpleNamespace(pp=pp, dp_replicate=dpr, tp=tp, get_mesh=lambda name: mesh)
    copies = tensor_parallel.plan_copies(dims)
    assert copies == [[0, 4], [1, 5], [2, 6], [3, 7]]


SEED = ["--debug.seed", "42", "--training.seq_len", "32", "--training.local_batch_size", "4"]
STEPS = 4


@pytest.mark.slow
def test_llama3_pp2_tp2_1f1b_matches_torch_per_parameter_and_its_checkpoint_resumes_under_torch(tmp_path):
    from titan_fork import run_titan_forked

    dumps = {engine: tmp_path / engine / "state" for engine in ("torch", "piper")}
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "checkpoint"]
    runs = {}
    for engine in ("torch", "piper"):
        runs[engine] = run_titan_forked(
            "llama3_debugmodel_pp2_tp2_1f1b", engine, dump_folder=tmp_path / engine, nproc=4, steps=STEPS,
            extra=[*SEED, "--piper.dump_state", str(dumps[engine]), *(checkpoint if engine == "piper" else [])],
            timeout_s=600)
        assert runs[engine].ok, runs[engine].tail()
        assert sorted(runs[engine].losses) == list(range(1, STEPS + 1)), runs[engine].tail()
    piper = runs["piper"]
    assert "Piper: recipe 1f1b, 2 stages on 2 ranks, 4 microbatches" in piper.log, piper.tail()
    assert runs["torch"].losses == piper.losses and runs["torch"].grad_norms == piper.grad_norms
    worst = state_differences(dumps["torch"], dumps["piper"], range(1, STEPS + 1), processes=4)
    assert max(worst.values()) <= 1e-5, worst

    # Piper's step-2 checkpoint, resumed by TorchTitan's own engine at tp=2: steps 3-4 as Piper ran them
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "piper" / "checkpoint" / "step-2", resumed_dir / "checkpoint" / "step-2")
    resumed = run_titan_forked("llama3_debugmodel_pp2_tp2_1f1b", "torch", dump_folder=resumed_dir, nproc=4,
                               steps=STEPS, extra=[*SEED, *checkpoint], timeout_s=600)
    assert resumed.ok, resumed.tail()
    assert "step-2" in resumed.log and sorted(resumed.losses) == [3, 4], resumed.tail()
    assert resumed.losses == {s: piper.losses[s] for s in (3, 4)}, (resumed.losses, piper.losses)
    assert resumed.grad_norms == {s: piper.grad_norms[s] for s in (3, 4)}
