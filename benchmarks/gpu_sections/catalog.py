"""The GPU suite's sections: letter and key, title, the function that runs it, its budget and expected time on one
H100. SECTIONS run by default (their budgets add up to less than 9 minutes); OPT_IN only when ``--only`` names them.
"""
from float8_gpt import float8_section
from memory_plan_gpu import memory_plan_section
from split_check_cost import split_check_section

from .activation_checkpointing import activation_checkpointing
from .amp_vs_fp32 import amp_vs_fp32
from .batch_size_and_oom import batch_size_and_oom
from .common import Section
from .data_path import data_path
from .fast_defaults import cuda_graphs, input_path, memory_format_and_fused
from .gpu_tests import gpu_tests
from .hand_loop_overhead import overhead
from .handler_cost import handler_cost
from .host_syncs import host_syncs
from .numerics import numerics

SECTIONS = (
    Section("a_gpu_tests", "a. GPU tests (pytest -m gpu)", gpu_tests, 185, 170),
    Section("b_overhead", "b. Overhead against the hand-written loop (ResNet-18, 32x32, batch 256)", overhead, 40, 25),
    Section("c_amp_vs_fp32", "c. AMP against float32 (ResNet-50, 224x224, batch 128)", amp_vs_fp32, 110, 100),
    Section("d_batch_size", "d. Batch-size search and out-of-memory recovery", batch_size_and_oom, 45, 35),
    Section("e_numerics", "e. Numerics parity (CIFAR ResNet-18 on shapes, 32x32)", numerics, 40, 30),
    Section("f_host_syncs", "f. Host syncs per iteration (bfloat16, default handlers)", host_syncs, 20, 12),
    Section("g_data_path", "g. Data path (num_workers, pin_memory)", data_path, 30, 25),
    Section("h_activation_checkpointing", "h. Activation checkpointing (GPT-style transformer, ResNet-50)",
            activation_checkpointing, 35, 25),
    # (budgets c, d, f and g gave 25 s to j: each keeps 5 s or more over its expected time)
    Section("j_handler_cost", "j. The handlers' host cost (small CNN, ResNet-50; benchmarks/overhead.py's table)",
            handler_cost, 25, 20),
)
# Run only when --only names them; their budgets are outside the 9 minutes of SECTIONS.
OPT_IN = (
    Section("i_float8", "i. float8 against bfloat16 (GPT 4 x 2048, sequence 1024, torch.compile)", float8_section,
            480, 330),
    Section("k_memory_plan", "k. Memory plan against max_memory_allocated (ResNet-50, GPT-style)",
            memory_plan_section, 240, 120),
    Section("l_split_check", "l. The split check's cost on the first step (GPT 8 x 1024, bfloat16, micro-batches 2)",
            split_check_section, 60, 30),
    # Issue 51's defaults on a GPU (opt-in while issue 48 rebalances the default budgets):
    Section("m_memory_format_fused", "m. Memory format and fused step with the defaults (ResNet-50, 224x224, batch "
            "128)", memory_format_and_fused, 90, 45),
    Section("n_input_path", "n. The input path with the defaults (the quickstart, num_workers auto against 0)",
            input_path, 75, 40),
    Section("o_cuda_graphs", "o. CUDA graphs against the eager step (CIFAR ResNet-18, 32x32, batch 256, bfloat16)",
            cuda_graphs, 180, 90),
)
