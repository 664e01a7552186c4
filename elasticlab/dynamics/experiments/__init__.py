"""The P3 reproduction experiments (papers.md, P3-T1..P3-T6), as functions returning plain numbers.

Each returns a JSON-friendly dict; ``details=True`` adds the task and trajectories (key ``"runs"``) for
plotting. Times are reported in GD steps (τ = 1/η steps). The tests in tests/dynamics/test_p3_claims.py
call these same functions with their defaults; the paper-reproduction registry can too.
"""
from elasticlab.dynamics.experiments.aligned_and_relu import (
    P3_T1_S,
    p3_layer_design,
    p3_t1_balancedness,
    p3_t2_saxe,
    p3_t3_phases,
    p3_t4_relu_no_bias,
    p3_t5_relu_bias,
    p3_t6_linearisation,
)
from elasticlab.dynamics.experiments.beyond_aligned import (
    P3_T9_CONFIGS,
    p3_t7_general_linear,
    p3_t8_pockets,
    p3_t9_phase_growth,
)

__all__ = ["p3_t1_balancedness", "p3_t2_saxe", "p3_t3_phases", "p3_t4_relu_no_bias", "p3_t5_relu_bias",
           "p3_t6_linearisation", "p3_layer_design", "P3_T1_S", "p3_t7_general_linear", "p3_t8_pockets",
           "p3_t9_phase_growth", "P3_T9_CONFIGS"]
