"""TorchTitan adapter: ``--parallelism.pipeline_engine piper`` and the CPU path.

    torchrun --nproc_per_node=2 -m torchtitan.train --module piper_plugin.adapters.torchtitan \\
        --config llama3_debugmodel --parallelism.pipeline_parallel_degree 2 \\
        --parallelism.pipeline_engine=piper

TorchTitan's ConfigManager imports ``piper_plugin.adapters.torchtitan.config_registry``.
"""
