"""Flags the Piper engine refuses end a ``torchtitan.train`` job before step 1 in one line.

Each rank checks the same flags while TorchTitan builds the trainer; the refusal is one
``piper: error:`` line naming the flag and the fix, exit status 2, no traceback (issue #19's bad
input: expert parallelism on a model without MoE layers, a DualPipeV stage count that does not
fit, an expert degree that does not divide the experts; issue #21's stage boundaries naming a
module the model does not have or leaving modules in no stage (TorchTitan's own engine trains
without them); issue #22's CUDA-only flags on CPU (memory snapshot, CUDA graphs)).
"""
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan")

from piper_plugin.adapters.torchtitan.flags import FlagError  # noqa: E402
from piper_plugin.adapters.torchtitan.pipelining import check_expert_split  # noqa: E402


def _program(experts_per_layer: list[int]):
    regions = {f"1.{2 * i + 1}": SimpleNamespace(params=(f"layers.{i}.moe.experts.w1",))
               for i in range(len(experts_per_layer))}
    shapes = {f"layers.{i}.moe.experts.w1": (n, 8, 4) for i, n in enumerate(experts_per_layer)}
    meta = SimpleNamespace(routed=tuple(regions), param_shapes=shapes)
    return SimpleNamespace(dag=SimpleNamespace(meta=meta, regions=regions))


def test_an_expert_degree_that_does_not_divide_the_experts_is_refused_with_the_degrees_that_do():
    check_expert_split(_program([8, 8]), 4)
    with pytest.raises(FlagError, match=r"--parallelism.expert_parallel_degree 3 does not divide the 8 experts"
                                        r".*one of \[2, 4, 8\]"):
        check_expert_split(_program([8, 8]), 3)
    with pytest.raises(FlagError, match=r"degree 4 does not divide the 6 experts.*one of \[2\]"):
        check_expert_split(_program([8, 6]), 4)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags, expected", [
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--parallelism.expert_parallel_degree", "2", "--piper.zero", "2", "activation-checkpoint:none"],
     "--parallelism.expert_parallel_degree 2: Llama3Model has no routed-expert (MoE) layer"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
         "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0,layers.1", "layers.2,layers.3",
         "layers.4,layers.5,norm,lm_head", "--training.local_batch_size", "4"],  # three parts
     "Piper recipe 'dualpipev' does not fit 3 stages on pp=2"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part",
         "tok_embeddings,layers.0,layers.1,layers.2", "layers.99,layers.3,layers.4,layers.5,norm,lm_head"],
     "--parallelism.module_fqns_per_model_part names 'layers.99', which Llama3Model does not have"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part",
         "tok_embeddings,layers.0,layers.1", "layers.2,norm,lm_head"],  # TorchTitan's engine drops layers 3-5
     "--parallelism.module_fqns_per_model_part leaves layers.3, layers.4, layers.5 in no stage"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--profiler.enable_memory_snapshot"],
     "--profiler.enable_memory_snapshot records the CUDA caching allocator's history"),
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "3"],
     "--parallelism degrees pipeline_parallel 2 x tensor_parallel 3 make 6 ranks but the job has 4"),
    (1, ["--training.no-disable-cuda-graphs"],  # with pp > 1 TorchTitan's own config check refuses it first
     "--training.no-disable-cuda-graphs asks for CUDA graph capture"),
    (2, ["--config", "llama3_debugmodel_float8_pp2_1f1b"],  # the last --config counts
     # torchao's float8 refuses a CPU (TorchTitan's converter), or is not installed
     "TorchTitan's config llama3_debugmodel_float8 cannot be built here: "),
], ids=["ep-without-moe", "dualpipev-odd-stages", "stage-names-a-missing-module", "stage-modules-left-out",
        "cuda-memory-snapshot-on-cpu", "tp-degrees-not-the-world", "cuda-graphs-on-cpu",
        "float8-on-cpu"])
def test_a_refused_flag_ends_the_job_in_one_line(tmp_path, nproc, flags, expected):
    from titan_fork import run_titan_forked

    run = run_titan_forked("llama3_debugmodel", "piper", dump_folder=tmp_path, nproc=nproc, steps=2, extra=flags,
                           timeout_s=300)
    errors = [line for line in run.log.splitlines() if line.startswith("piper: error:")]
    assert run.returncode == 2 and not run.losses, run.tail()
    assert len(errors) == 1 and expected in errors[0], run.tail()
    assert "Traceback" not in run.log, run.tail()
