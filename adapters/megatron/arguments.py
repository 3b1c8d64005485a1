"""Megatron-LM's command line for :mod:`.pretrain_gpt`: its argument names and defaults, plus
the engine switch (``--pipeline-engine``) and Piper's own (``--piper-recipe``).

Every check runs before any process group or model exists; a refused argument ends the run
with one ``piper: error:`` line naming it and the fix (:class:`~.schedule.ArgumentError`).
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from piper_plugin.adapters.megatron.schedule import ArgumentError
from piper_plugin.adapters.megatron.zero import LEVELS

__all__ = ["parse_args", "validate", "ENGINES"]

ENGINES = ("megatron", "piper")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ArgumentError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m piper_plugin.adapters.megatron.pretrain_gpt",
                description="Pretrain a GPT with Megatron-Core; --pipeline-engine=piper runs the pipeline "
                            "with Piper, =megatron with Megatron's own schedules.")
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x --hidden-size")
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--num-experts", type=int, default=None)
    model.add_argument("--moe-router-topk", type=int, default=2)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    model.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, required=True)
    train.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")
    train.add_argument("--train-iters", type=int, required=True)
    train.add_argument("--lr", type=float, required=True)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--eval-interval", type=int, default=None,
                       help="evaluate on the validation split every N iterations (and after the last one)")
    train.add_argument("--eval-iters", type=int, default=0,
                       help="global batches per evaluation (Megatron-LM's; default 0 here: no evaluation)")
    train.add_argument("--log-interval", type=int, default=100)
    train.add_argument("--use-distributed-optimizer", action="store_true")
    train.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                       help="activation recomputation, as Megatron-LM's (full needs --recompute-method)")
    train.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    train.add_argument("--recompute-num-layers", type=int, default=None)
    train.add_argument("--bf16", action="store_true", help="refused: this entry computes in float32")
    train.add_argument("--fp16", action="store_true", help="refused: this entry computes in float32")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="Megatron's tensor parallelism inside each stage (column/row-parallel layers)")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="Megatron's sequence parallelism over the tensor-parallel ranks (needs TP > 1)")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                     help="layers of the first pipeline stage (uneven split; the rest split evenly)")
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                     help="layers of the last pipeline stage (uneven split; the rest split evenly)")
    par.add_argument("--expert-model-parallel-size", type=int, default=1)
    par.add_argument("--data-parallel-size", type=int, default=None,
                     help="default: world size / (tensor x pipeline); if given it must equal that")
    data = p.add_argument_group("data and checkpoints")
    data.add_argument("--data-path", default=None,
                      help="prefix of a Megatron indexed dataset (.bin/.idx); default: the corpus Piper ships")
    data.add_argument("--tokenizer-file", default=None,
                      help="a tokenizers JSON file for --data-path's vocabulary; default: the one Piper ships")
    data.add_argument("--split", default=None,
                      help="train, validation, test weights of the documents, as Megatron-LM's (default: 969,30,1 "
                           "with --eval-iters, else 100,0,0: every document trains)")
    data.add_argument("--save", default=None)
    data.add_argument("--load", default=None)
    data.add_argument("--save-interval", type=int, default=None)
    engine = p.add_argument_group("engine")
    engine.add_argument("--pipeline-engine", choices=ENGINES, default="megatron",
                        help="megatron: Megatron's own schedules (the baseline); piper: Piper's plan")
    engine.add_argument("--piper-recipe", default=None,
                        help="Piper recipe name, recipe file or JSON trace (default: 1f1b, interleaved-1f1b with a "
                             "virtual pipeline)")
    engine.add_argument("--piper-zero", type=int, default=None, metavar="{1,2,3}",
                        help="Piper's ZeRO over the data-parallel ranks instead of Megatron's DDP: 1 shards the "
                             "optimizer state, 2 also the gradients (reduce-scattered per microbatch), 3 also the "
                             "parameters (gathered per microbatch, freed after use)")
    engine.add_argument("--piper-timeout", type=float, default=300.0, help="seconds any distributed wait may take")
    engine.add_argument("--piper-trace", default=None, metavar="DIR",
                        help="write every step's measured timeline and wall time here (plan.pkl, rank<N>.json: "
                             "what `piper calibrate --host megatron` reads)")
    engine.add_argument("--piper-trace-memory", action="store_true",
                        help="with --piper-trace: also count saved activations on the memory meter and record each "
                             "step's peak transient memory (what `piper calibrate --host megatron` fits memory from)")
    engine.add_argument("--piper-profile", default=None, metavar="FILE.json",
                        help="a cost profile (`piper calibrate`): print the plan's step as it predicts it")
    return p


def parse_args(argv: Sequence[str] | None, world_size: int) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    validate(args, world_size)
    return args


def validate(args: argparse.Namespace, world: int) -> None:
    """Derived sizes, and every combination refused with the argument to change."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
                 "pipeline_model_parallel_size", "tensor_model_parallel_size", "expert_model_parallel_size"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer")
    for flag in ("bf16", "fp16"):
        if getattr(args, flag):
            raise ArgumentError(f"--{flag}: this entry builds float32 models (Megatron's Float16Module and loss "
                                f"scaling are not wired here); drop --{flag}")
    if args.recompute_granularity == "full" and (args.recompute_method is None or not args.recompute_num_layers):
        raise ArgumentError("--recompute-granularity full needs --recompute-method uniform|block and "
                            "--recompute-num-layers N, as in Megatron-LM")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise ArgumentError("--recompute-method / --recompute-num-layers apply to --recompute-granularity full; "
                            "add it or drop them")
    tp = args.tensor_model_parallel_size
    _check_tensor_parallel(args, tp)
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if world % (pp * tp):
        sizes = f"--pipeline-model-parallel-size {pp}" + (f" x --tensor-model-parallel-size {tp}" if tp > 1 else "")
        raise ArgumentError(f"{sizes} does not divide the {world} ranks; launch a multiple of {pp * tp} ranks "
                            f"(--nproc_per_node)")
    dp = world // (pp * tp)
    if args.data_parallel_size is not None and args.data_parallel_size != dp:
        raise ArgumentError(f"--data-parallel-size {args.data_parallel_size}: {world} ranks / (pipeline {pp} x tensor "
                            f"{tp}) give {dp}; drop it or launch {args.data_parallel_size * pp * tp} ranks")
    args.data_parallel_size = dp
    chunks = vpp or 1
    if vpp is not None and (vpp < 2 or pp < 2):
        raise ArgumentError(f"--virtual-pipeline-model-parallel-size {vpp}: needs a value >= 2 and "
                            f"--pipeline-model-parallel-size >= 2")
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _check_uneven(args, pp, vpp, first, last)
    elif args.num_layers % (pp * chunks):
        raise ArgumentError(f"--num-layers {args.num_layers} does not split evenly over {pp * chunks} stages "
                            f"(--pipeline-model-parallel-size {pp}"
                            f"{f' x --virtual-pipeline-model-parallel-size {vpp}' if vpp else ''}); use a multiple")
    ep = args.expert_model_parallel_size
    if ep > 1 and not args.num_experts:
        raise ArgumentError(f"--expert-model-parallel-size {ep} without --num-experts: a model without experts; "
                            f"add --num-experts or set it to 1")
    if args.num_experts and (args.num_experts % ep or dp % ep):
        raise ArgumentError(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts} and "
                            f"the data-parallel size {dp}")
    if args.num_experts and args.moe_router_topk > args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                            f"{args.micro_batch_size} x data-parallel size {dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if vpp is not None and args.pipeline_engine == "megatron" and args.num_microbatches % pp:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} gives {args.num_microbatches} microbatches; "
                            f"Megatron's interleaved schedule needs a multiple of --pipeline-model-parallel-size {pp}")
    for flag in ("piper_recipe", "piper_trace", "piper_trace_memory", "piper_profile"):
        if getattr(args, flag) and args.pipeline_engine != "piper":
            raise ArgumentError(f"--{flag.replace('_', '-')} is Piper's; add --pipeline-engine=piper")
    if args.piper_trace_memory and not args.piper_trace:
        raise ArgumentError("--piper-trace-memory records into the step trace: add --piper-trace DIR")
    _check_zero(args, dp, ep)
    _check_files(args)
    _check_evaluation(args)
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval without --save: name the folder checkpoints go to")
    if args.save_interval is not None and args.save_interval < 1:
        raise ArgumentError(f"--save-interval {args.save_interval}: must be a positive number of iterations")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.num_attention_heads and args.hidden_size % args.num_attention_heads:
        raise ArgumentError(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                            f"{args.num_attention_heads}")


def _check_tensor_parallel(args: argparse.Namespace, tp: int) -> None:
    """What the tensor-parallel size must divide, and sequence parallelism's conditions (Megatron's)."""
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel splits the sequence over the tensor-parallel ranks: add "
                            "--tensor-model-parallel-size > 1 or drop it")
    if tp == 1:
        return
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    for flag, value in (("--num-attention-heads", args.num_attention_heads), ("--hidden-size", args.hidden_size),
                        ("--ffn-hidden-size", ffn)):
        if value % tp:
            raise ArgumentError(f"--tensor-model-parallel-size {tp} does not divide {flag} {value} (each "
                                f"tensor-parallel rank holds {flag.removeprefix('--')} / size of it); use a divisor "
                                f"of {value}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel with --tensor-model-parallel-size {tp} does not divide --seq-length "
                            f"{args.seq_length}; use a multiple of {tp}")
    if args.num_experts and not args.sequence_parallel:
        raise ArgumentError(f"--num-experts with --tensor-model-parallel-size {tp}: Megatron's MoE layers need "
                            f"--sequence-parallel under tensor parallelism; add it")


def _check_evaluation(args: argparse.Namespace) -> None:
    """``--eval-interval`` / ``--eval-iters`` / ``--split``: Megatron-LM's evaluation; sets
    ``args.split`` to the three weights."""
    if args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters {args.eval_iters}: must be 0 (no evaluation) or a number of global batches")
    if args.eval_interval is not None and args.eval_interval < 1:
        raise ArgumentError(f"--eval-interval {args.eval_interval}: must be a positive number of iterations")
    if args.eval_interval is not None and not args.eval_iters:
        raise ArgumentError(f"--eval-interval {args.eval_interval} without --eval-iters: say how many global batches "
                            f"each evaluation runs (--eval-iters N)")
    text = args.split or ("969,30,1" if args.eval_iters else "100,0,0")
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ArgumentError(f"--split {text}: give three non-negative weights, train,validation,test (e.g. 969,30,1)")
    if args.eval_iters and not weights[1]:
        raise ArgumentError(f"--eval-iters {args.eval_iters} with --split {text}: no document is for validation; "
                            f"give the second weight a share (e.g. 969,30,1)")
    if not weights[0]:
        raise ArgumentError(f"--split {text}: no document is for training; give the first weight a share")
    args.split = ",".join(f"{w:g}" for w in weights)


def _check_files(args: argparse.Namespace) -> None:
    """The dataset and tokenizer a run reads exist (before any rank starts)."""
    prefix = args.data_path
    if prefix is not None:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ArgumentError(f"--data-path {prefix}: no {' / '.join(prefix + ext for ext in missing)}; give the "
                                f"prefix of a Megatron indexed dataset (as preprocess_data.py writes it)")
    if args.tokenizer_file is not None and not os.path.isfile(args.tokenizer_file):
        raise ArgumentError(f"--tokenizer-file {args.tokenizer_file}: no such file; give a tokenizers JSON file, "
                            f"or drop it for the one Piper ships")


def _check_zero(args: argparse.Namespace, dp: int, ep: int) -> None:
    zero = args.piper_zero
    if zero is None:
        return
    if zero not in LEVELS:
        raise ArgumentError(f"--piper-zero {zero}: the level is {', '.join(map(str, LEVELS[:-1]))} or {LEVELS[-1]}")
    if args.pipeline_engine != "piper":
        raise ArgumentError(f"--piper-zero {zero} is Piper's ZeRO inside Piper's plan; add --pipeline-engine=piper "
                            f"(Megatron's engine shards with --use-distributed-optimizer)")
    if dp < 2:
        raise ArgumentError(f"--piper-zero {zero} with data-parallel size 1: ZeRO shards over the data-parallel "
                            f"ranks; launch a multiple of {2 * args.pipeline_model_parallel_size} ranks or drop "
                            f"--piper-zero")
    if args.use_distributed_optimizer:
        raise ArgumentError(f"--piper-zero {zero} with --use-distributed-optimizer: Piper's ZeRO shards the "
                            f"optimizer state itself; drop --use-distributed-optimizer")


def _check_uneven(args: argparse.Namespace, pp: int, vpp: int | None, first: int | None, last: int | None) -> None:
    """Megatron's uneven split: the first / last stage's layer counts given, the rest even."""
    if vpp is not None:
        raise ArgumentError("--decoder-first/last-pipeline-num-layers with --virtual-pipeline-model-parallel-size: "
                            "give an even split (--num-layers a multiple of the stages) instead")
    if pp < 2:
        raise ArgumentError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size >= 2")
    rest, stages = args.num_layers, pp
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if n < 1:
            raise ArgumentError(f"{flag} {n}: must be a positive number of layers")
        rest, stages = rest - n, stages - 1
    if rest < 0 or (stages and (rest % stages or rest == 0)) or (not stages and rest):
        raise ArgumentError(f"--num-layers {args.num_layers} with first {first} / last {last} leaves {rest} layers "
                            f"for {stages} middle stages; they must split evenly, at least one each")
