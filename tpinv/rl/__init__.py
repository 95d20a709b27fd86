"""RL on top of the invariant model: multi-turn packing and rollout-vs-trainer mismatch corrections.

:mod:`tpinv.rl.multiturn` packs a conversation into one training row whose log-probs are the
rollout's bits; :mod:`tpinv.rl.mismatch` holds the importance-sampling corrections (TIS, MIS,
clipping, rejection, catastrophic-token veto) a vanilla trainer needs -- and which the
invariant path turns into the identity (every ratio exactly 1).
"""
