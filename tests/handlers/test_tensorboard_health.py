"""The end-of-run health summary's wording, from figures (no run needed)."""
from ignite_amp.handlers.tensorboard.health import Health, health_lines


def window(samples=100.0, step_ms=50.0, wait=0.01, clip=None, clip_steps=0, norm=None, tflops=None, mfu=None,
           iterations=10):
    w = {"throughput/samples_per_sec": samples, "throughput/step_time_ms": step_ms,
         "throughput/data_wait_share": wait, "iterations": iterations, "clip_steps": clip_steps}
    for key, value in (("optimizer/clip_share", clip), ("optimizer/grad_norm", norm), ("throughput/tflops", tflops),
                       ("throughput/mfu", mfu)):
        if value is not None:
            w[key] = value
    return w


def test_a_healthy_bfloat16_run_has_no_warning():
    lines = health_lines(Health("bfloat16", False, [window(clip=0.0, clip_steps=10, norm=2.0)] * 3, 30, 0,
                                max_norm=5.0, peak_memory_mb=900.0, memory_kind="RSS"))
    assert lines == ["verdict: healthy (clipping and data wait within bounds)",
                     "precision: bfloat16 autocast (no GradScaler needed), 30 optimizer steps",
                     "clipping: 0% of optimizer steps clipped at max_norm 5, median grad norm 2",
                     "speed: 100 samples/s, 50 ms per iteration (medians of 3 logged windows)",
                     "data wait: 1.0% of the time",
                     "memory: peak 900 MB (RSS)"]
    assert all(len("  " + line) <= 80 for line in lines)  # as the run prints them, indented


def test_the_verdict_counts_the_warnings_and_float32_reads_as_one_label():
    windows = [window(clip=1.0, clip_steps=10, norm=3.0, wait=0.5)]
    lines = health_lines(Health("float32", False, windows, 5, 0, max_norm=1.0))
    assert lines[:2] == ["verdict: 2 warnings below, each with the change to make",
                         "precision: float32 (autocast off), 5 optimizer steps"]
    assert len([line for line in lines if line.startswith("warning:")]) == 2
    assert health_lines(Health("float16", True, [window()], 99, 1))[0] == (
        "verdict: healthy (skipped steps and data wait within bounds)")


def test_clipping_most_steps_is_a_warning_with_what_to_do():
    windows = [window(clip=1.0, clip_steps=10, norm=3.0), window(clip=0.8, clip_steps=10, norm=2.0)]
    lines = health_lines(Health("float32", False, windows, 20, 0, max_norm=1.0, from_config=True))
    assert "clipping: 90% of optimizer steps clipped at max_norm 1, median grad norm 2.5" in lines
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert "raise handlers.clipping.max_norm (to about 5) or lower the lr" in warning


def test_advice_names_python_arguments_in_a_script():
    """Issue 28: a Python run is told of its arguments, not of config keys it never wrote."""
    windows = [window(clip=1.0, clip_steps=10, norm=3.0, wait=0.5)]
    script = " ".join(health_lines(Health("float16", True, windows, 5, 5, max_norm=1.0)))
    config = " ".join(health_lines(Health("float16", True, windows, 5, 5, max_norm=1.0, from_config=True)))
    for key, argument in (("amp.dtype bfloat16", 'dtype="bfloat16"'),
                          ("handlers.clipping.max_norm", "GradientClipping's max_norm"),
                          ("data.num_workers", "the DataLoader num_workers")):
        assert argument in script and key not in script
        assert key in config


def test_float16_skips_and_loss_scale():
    lines = health_lines(Health("float16", True, [window()], 90, 10, loss_scale=1024.0))
    assert lines[1] == ("precision: float16 with GradScaler, 10 of 100 optimizer steps skipped (10.0%), final loss "
                        "scale 1024")
    assert lines[2].startswith("warning: 10% of float16 steps skipped") and "bfloat16" in lines[2]
    assert not [x for x in health_lines(Health("float16", True, [window()], 99, 1)) if x.startswith("warning")]


def test_a_data_bound_run_names_the_loader():
    lines = health_lines(Health("bfloat16", False, [window(wait=0.5, iterations=30), window(wait=0.1)], 40, 0))
    assert lines[3] == "data wait: 40.0% of the time"  # weighted by the windows' iterations
    assert lines[4].startswith("warning: 40% of the time goes to waiting for batches") and "num_workers" in lines[4]


def test_compute_and_mfu_and_oom():
    lines = health_lines(Health("bfloat16", False, [window(tflops=300.0, mfu=0.3)], 10, 0, oom_retries=2,
                                micro_batches=4, micro_batch_size=16, flops_per_sample=3e9,
                                peak_name="H100 bfloat16 dense peak"))
    assert "compute: 300 TFLOP/s (3 GFLOP per sample, forward + backward); MFU 30.0% of the H100 " \
           "bfloat16 dense peak" in lines
    assert lines[-1] == "out of memory: 2 retries; now 4 micro-batches per batch, micro-batches of 16"


def test_a_run_stopped_before_its_first_window_still_says_its_precision():
    assert health_lines(Health("bfloat16", False, [], 0, 0)) == [
        "verdict: healthy, nothing to warn about",
        "precision: bfloat16 autocast (no GradScaler needed), 0 optimizer steps"]


def test_speed_and_compute_say_per_process_under_data_parallel():
    lines = health_lines(Health("bfloat16", False, [window(tflops=2.0)], 10, 0, flops_per_sample=1e9, processes=2))
    assert "samples/s per process (2 processes)" in lines[2] and "TFLOP/s per process" in lines[4]


def test_a_float8_run_states_mfu_against_both_peaks():
    w = dict(window(tflops=600.0, mfu=0.6), **{"throughput/mfu_float8": 0.3})
    lines = health_lines(Health("bfloat16", False, [w], 10, 0, flops_per_sample=3e9,
                                peak_name="H100 bfloat16 dense peak"))
    assert "compute: 600 TFLOP/s (3 GFLOP per sample, forward + backward); MFU 60.0% of the H100 " \
           "bfloat16 dense peak, 30.0% of the float8 dense peak" in lines
