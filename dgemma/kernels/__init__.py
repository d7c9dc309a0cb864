"""Device-specific kernels behind the model's matmuls and the sampler's step (the maths stays in
model/ and engine/sampler.py; kernels/choice.py decides which of these run)."""

# exp(x) for x below ln(FLT_MIN) ~ -87.3 is a float32 denormal, which x86 computes up to 80x more
# slowly (measured: 157 ms vs 2 ms for 8M values). Clamping d there raises such weights to
# exp(-87) ~ 1.6e-38 relative to the top token's 1: no float32 sum, entropy or sample changes.
# Every step-statistics path clamps there: engine/sampler.py, triton_step.py and
# csrc/step_statistics.cpp (its kExpFloor).
EXP_FLOOR = -87.0
