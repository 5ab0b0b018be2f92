"""A checkpointed run for tests/test_checkpoint.py: trains and saves its final weights and metrics.

Usage: python checkpointed_run.py OUT_DIR [--resume]   (writes OUT_DIR/trace.jsonl, OUT_DIR/ck/,
OUT_DIR/weights.npy, OUT_DIR/metrics.json)
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic  # noqa: E402


def main() -> int:
  out = sys.argv[1]
  config = RunConfig.of(cluster="hetero4", num_vws=3, stages=2, nm=(2, 3, 1), d=1, waves=40, optimizer="adam",
                     learning_rate=0.01, trace_path=os.path.join(out, "trace.jsonl"),
                     checkpoint_dir=os.path.join(out, "ck"), checkpoint_every=4, keep_checkpoints=2,
                     failures=[(1, 11), (2, 25)], rejoin=True,
                     resume="--resume" in sys.argv)
  result = run_hetpipe(get_model("mlp"), synthetic(), config)
  leaves = jax.tree.leaves(jax.device_get(result.params))
  np.save(os.path.join(out, "weights.npy"), np.concatenate([np.ravel(x) for x in leaves]))
  with open(os.path.join(out, "metrics.json"), "w", encoding="utf-8") as f:
    json.dump(result.metrics, f)
  print("resumed from", result.checkpoints["resumed_from"], flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
