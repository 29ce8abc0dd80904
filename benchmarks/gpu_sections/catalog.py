"""The GPU suite's sections: letter and key, title, the function that runs it, its budget and expected time on one
H100. SECTIONS run by default (their budgets and the start-up add up to 6 minutes: a GPU is lent for about 15, start
included); OPT_IN only when ``--only`` names them, each with its own budget.
"""
from float8_gpt import float8_section
from memory_plan_gpu import memory_plan_section
from split_check_cost import split_check_section

from .activation_checkpointing import activation_checkpointing, checkpointing_policies
from .amp_vs_fp32 import amp_more, amp_vs_fp32
from .batch_size_and_oom import batch_size_and_oom
from .common import Section
from .data_path import data_path
from .fast_defaults import cuda_graphs, input_path, memory_format_and_fused
from .gpu_tests import gpu_tests, resnet50_search_test
from .hand_loop_overhead import overhead
from .handler_cost import handler_cost
from .host_syncs import host_syncs
from .numerics import numerics

SECTIONS = (  # budgets from the H100's times of 2026-11-27 where a section ran, else estimates
    Section("a_gpu_tests", "a. GPU tests (pytest -m gpu, but the ResNet-50 search: n)", gpu_tests, 60, 45),
    Section("b_overhead", "b. Overhead against the hand-written loop (launch-bound ResNet-18 32x32, device-bound "
            "ResNet-50 224x224)", overhead, 40, 35),
    Section("c_amp_vs_fp32", "c. AMP against float32 (ResNet-50, 224x224, batch 128; NCHW and channels_last)",
            amp_vs_fp32, 85, 75),
    Section("d_batch_size", "d. Batch-size search and out-of-memory recovery", batch_size_and_oom, 40, 30),
    Section("e_numerics", "e. Numerics parity (CIFAR ResNet-18 on shapes, 32x32)", numerics, 40, 30),
    Section("f_host_syncs", "f. Host syncs per iteration (bfloat16, default handlers)", host_syncs, 15, 12),
    Section("g_data_path", "g. Data path (num_workers, pin_memory)", data_path, 25, 20),
    Section("h_activation_checkpointing", "h. Activation checkpointing (GPT-style transformer, ResNet-50)",
            activation_checkpointing, 25, 18),
    Section("j_handler_cost", "j. The handlers' host cost (small CNN, ResNet-50; benchmarks/overhead.py's table)",
            handler_cost, 20, 15),
)
# Run only when --only names them; their budgets are outside the 6 minutes of SECTIONS.
OPT_IN = (
    Section("i_float8", "i. float8 against bfloat16 (GPT 4 x 2048, sequence 1024, torch.compile)", float8_section,
            480, 330),
    Section("k_memory_plan", "k. Memory plan against max_memory_allocated (ResNet-50, GPT-style)",
            memory_plan_section, 240, 120),
    Section("l_split_check", "l. The split check's cost on the first step (GPT 8 x 1024, bfloat16, micro-batches 2)",
            split_check_section, 60, 30),
    Section("m_amp_more", "m. IEEE float32 and torch.compile (section c's other rows)", amp_more, 120, 90),
    Section("n_resnet50_search_test", "n. Issue 13's ResNet-50 search test (pytest)", resnet50_search_test, 150, 120),
    # Expected on one H100: section h's 25 s for none and full, ~15 s more for selective and ~8 s for GPT auto
    Section("s_checkpointing_policies", "s. Activation checkpointing policies: none, selective, full, auto (GPT, "
            "ResNet-50)", checkpointing_policies, 90, 50),
    # Issue 51's defaults on a GPU (opt-in: outside the default suite's 6 minutes):
    Section("p_memory_format_fused", "p. Memory format and fused step with the defaults (ResNet-50, 224x224, batch "
            "128)", memory_format_and_fused, 90, 45),
    Section("q_input_path", "q. The input path with the defaults (the quickstart: data on the GPU, workers auto, 0)",
            input_path, 75, 60),
    Section("r_cuda_graphs", "r. CUDA graphs against the eager step (CIFAR ResNet-18, 32x32, batch 256, bfloat16)",
            cuda_graphs, 180, 90),
)
