"""Test setup: 8 simulated CPU devices and strict JAX flags, before jax is imported.

No persistent compilation cache, in-process or in the subprocesses tests launch
(JAX_ENABLE_COMPILATION_CACHE=false is inherited): with jaxlib 0.10.2 on CPU an
8-device step with collectives loaded from that cache can deadlock its device
threads in a collective, and XLA aborts the process after its 40 s rendezvous
timeout ("Fatal Python error: Aborted"); compiled afresh the same step runs. Seen with
expert-parallel all_to_all every time, and under 2 xdist workers with data-parallel
MoE, remat, pipeline and plain data-parallel runs (an lm-eval harness run in CI). A
cold cache saved the suite about a fifth of its CPU time; a crash costs the whole run.
"""

import os

# Test programs are tiny: LLVM's optimisation of the CPU code costs far more
# (about half of the suite's time) than it saves, so tests compile at -O0.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


# The slow tier (`make test-slow`, run by .ci/run after `make test`): the scenarios that
# cost over ~15 s each on 2 cores. They keep their files (beside what they test); this list
# marks them so `make test` stays under its 10-minute budget (docs/testing.md, "Tiers").
SLOW = (
    # Each over ~15 s on a quiet 2-core machine (moved when `make test` passed 10 min).
    "tests/parallel/test_mesh.py::test_two_processes_build_a_global_batch",
    "tests/train/test_goodput.py::test_a_run_killed_once_counts_the_steps_it_trained_again",
    "tests/train/test_z_loss.py::test_z_loss_gradient_and_logit_telemetry_match_the_full_logits",
    "tests/train/test_kron.py::test_first_update_is_psgd_kron_with_our_decay_lr_and_clip",
    "tests/experiments/test_positional_fairness.py::test_learned_positions_train_differently_from_nope",
    "tests/experiments/test_report_sensitivity.py::test_smoke_sweep_lr_sensitivity",
    "tests/experiments/test_optimizer_ablation.py::test_recipe_end_to_end_at_smoke_size",
    "tests/experiments/test_probes.py::test_coord_check_across_widths",
    "tests/benchmarks/test_sections_smoke.py",
    "tests/parallel/test_expert_cli.py",
    "tests/train/test_quantized_training.py",
    "tests/model/test_quantization.py::test_int8_on_a_mesh_equals_no_mesh",
    "tests/model/test_mup.py",
    "tests/parallel/test_context.py::test_context_parallel_training_matches_one_device",
    "tests/parallel/test_train_equivalence.py::test_sharded_training_matches_one_device",
    "tests/model/test_patterns.py::test_scan_equals_no_scan",
    "tests/train/test_convert.py::test_gqa_ablation_uptrains_and_reports_side_by_side",
    "tests/experiments/test_sweep_only.py::test_sigterm_to_a_parallel_sweep_reaches_its_points",
    "tests/train/test_moe_training.py::test_moe_run_launched_like_make_train_resumes_exactly",
    "tests/train/data/test_mqar.py::test_task_mqar_recipe_learns_the_binding",
    "tests/train/test_rundir.py::test_nonfinite_stop_keeps_the_checkpoint_it_names_and_says_so",
    "tests/train/test_rundir.py::test_every_refusal_exits_nonzero_with_no_thread_outliving_it",
    "tests/model/test_mla.py::test_mla_shards_heads_over_tensor_and_trains_like_one_device",
    "tests/model/test_moe.py::test_transformer_with_moe_scanned_equals_unscanned",
    "tests/parallel/test_expert.py::test_transformer_expert_parallel_equals_capacity_under_mesh",
    "tests/train/test_spikes.py::test_rollback_skips_the_window_once_and_a_resume_from_its_checkpoint_is_exact",
    "tests/train/test_bucket_training.py::test_sigkill_of_a_bucket_run_then_resume_is_bitwise",
    "tests/train/test_bucket_training.py::test_a_bucket_run_killed_before_its_first_commit",
    "tests/experiments/test_sweep_bucket.py",
    "tests/train/test_bucket_modes.py",
    "tests/train/test_local_checkpoint.py::test_killed_after_a_local_save",
    "tests/train/test_optimizers.py::test_muon_sharded_equals_one_device_without_gathering_a_weight",
    "tests/train/test_kron.py::test_trains_through_launch_and_resumes_bitwise",
    "tests/train/test_optimizers.py::test_trains_through_launch_and_resumes_bitwise[muon]",
    "tests/train/test_optimizers.py::test_trains_through_launch_and_resumes_bitwise[adafactor]",
    "tests/train/test_optimizers.py::test_trains_through_launch_and_resumes_bitwise[schedule_f",
    "tests/train/test_optimizers.py::test_first_update_matches_the_formula[muon_moe]",
    "tests/train/test_optimizers.py::test_first_update_matches_the_formula[muon_bf16]",
    "tests/train/test_optimizers.py::test_mup_scales_the_hidden_matrices_updates_by_one_over_m[muon]",
    "tests/train/test_local_checkpoint.py::test_a_bucket_run_resumes_from_the_newer_tier",
    "tests/train/test_remat_policies.py::test_every_policy_trains",
    "tests/train/test_remat_policies.py::test_mla_and_moe_train",
    "tests/train/test_bucket_writes.py::test_a_sweep_branch_into_a_bucket_copies_the_step",
    "tests/train/test_bucket_writes.py::test_a_parallel_sweep_into_a_bucket",
    "tests/parallel/test_context.py::test_one_step_gradients_equal_one_device",
    "tests/train/test_chaos.py",
    "tests/train/test_z_loss.py::test_z_loss_gradient_and_logit_telemetry_match_the_full_logits[1]",
    # The gs:// twins (fixture `bucket`) of run-level bucket tests whose s3:// run stays.
    "tests/train/test_bucket_records.py::test_train_resume_and_eval_of_a_bucket_run_through_launch[gs]",
    "tests/experiments/test_report_bucket.py::test_a_bucket_sweep_root_reports_what_a_local_one_does[gs]",
    "tests/parallel/test_pipeline.py::test_pipelined_training_matches_one_device",
    "tests/parallel/test_pipeline.py::test_a_stage2_checkpoint_resumes_on_another_stage_count",
    "tests/parallel/test_pipeline.py::test_a_resume_on_the_same_stages_is_bitwise",
    "tests/parallel/test_pipeline.py::test_the_launched_step_cuts_the_layers_and_permutes",
    "tests/benchmarks/test_pipeline_bubble.py",
    "tests/parallel/test_pipeline_1f1b.py::test_1f1b_training_through_launch",
    "tests/parallel/test_pipeline_1f1b.py::test_1f1b_holds_at_most",
    "tests/parallel/test_pipeline_1f1b.py::test_a_gpipe_checkpoint_resumes_with_1f1b",
    "tests/parallel/test_pipeline_1f1b.py::test_zero_bubble_with_remat",
    # The circular schedule's launch.py runs (tests/parallel/test_pipeline_circular.py).
    "tests/parallel/test_pipeline_circular.py::test_circular_training_matches_one_device",
    "tests/parallel/test_pipeline_circular.py::test_a_checkpoint_resumes_with_other_repeats",
    "tests/parallel/test_pipeline_circular.py::test_a_resume_with_the_same_repeats_is_bitwise",
    "tests/parallel/test_pipeline_circular.py::test_evaluation_reads_each_layout_with_its_schedule",
    "tests/parallel/test_pipeline_circular.py::test_the_local_tier_saves_in_layer_order",
    "tests/parallel/test_pipeline_moe.py::test_moe_and_mla_in_stages_train_like_one_device",
    "tests/parallel/test_pipeline_moe.py::test_moe_transformer_on_stages_equals_no_mesh",
    "tests/benchmarks/test_preemption.py",
    # Each 10-15 s (make test measured 10:24 with them on a quiet machine).
    "tests/parallel/test_pipeline.py::test_transformer_on_stages_with_tensor_inside",
    "tests/parallel/test_pipeline.py::test_the_head_runs_data_parallel_over_the_stages",
    "tests/parallel/test_pipeline_circular.py::test_transformer_circular_with_tensor_inside",
    "tests/train/test_loop.py::test_killed_before_its_first_checkpoint_restarts_bitwise",
    "tests/train/test_kron.py::test_each_layer_of_a_scanned_stack_is_preconditioned_apart",
    "tests/train/test_loss.py::test_launch_trains_the_same_with_any_chunking",
    # Over 14 s on this stop's (slower) 2-core machine, where make test measured 10:24.
    "tests/parallel/test_context.py::test_resume_from_context4_on_context1",
    "tests/train/test_bucket_records.py::test_train_resume_and_eval_of_a_bucket_run_through_launch",
    "tests/train/test_loop.py::test_sigkill_then_resume_is_bitwise_identical",
    "tests/train/test_bucket_training.py::test_a_bucket_run_resumes_bitwise_past_a_corrupted",
    "tests/train/test_goodput.py::test_two_attempts_are_recorded_and_reported",
    "tests/train/test_telemetry.py::test_mla_reports_the_same_max_logit_from_both_impls",
    "tests/experiments/test_sweep.py::test_evaluation_points_train_nothing_and_are_report_rows",
    # 7-11 s twins of a case that stays (make test measured 10:06 under load 3): the
    # bfloat16, xla, remat=full, scanned and local cases keep each property in make test.
    "tests/model/test_quantization.py::test_int8_model_tracks_the_unquantized_one_and_adds_no_variables[float32]",
    "tests/model/test_quantization.py::test_int8_is_the_same_function_scanned_unrolled_and_rematerialised[unscanned]",
    "tests/train/test_telemetry.py::test_step_telemetry_equals_direct_computation[blockwise-2]",
    "tests/train/test_remat_policies.py::test_a_policy_trains_with_the_losses_of_no_remat[minimal_offloaded]",
    "tests/train/test_bucket_writes.py::test_profile_steps_write_the_trace_into_a_bucket_run",
)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.nodeid.startswith(SLOW):
      item.add_marker(pytest.mark.slow)


# Object-storage servers on localhost (moto S3, tests/gcs_server.py): tests/storage_servers.py.
from tests.storage_servers import (bucket, gcs_bucket, gcs_server, s3_bucket,  # noqa: E402,F401
                                   s3_lossy, s3_server)
