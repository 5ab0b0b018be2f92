# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # hetpipe_jax in one sitting: plan, simulate, train and check HetPipe on a heterogeneous cluster
#
# HetPipe (Park et al., USENIX ATC 2020) trains one model on GPUs of different speeds and memory sizes by
# combining two kinds of parallelism:
#
# * **Virtual workers** (VWs). A few GPUs are grouped into one virtual worker, which runs *pipelined model
#   parallelism*: the model is cut into stages, one per GPU, and up to **Nm** minibatches are in flight
#   at once (PipeDream-style, with weight stashing: each backward uses the weights its forward used).
#   Every minibatch is a full SGD step; there is no pipeline flush.
# * **Wave Synchronous Parallel** (WSP). The virtual workers train in data parallel through a parameter
#   server (PS). A *wave* is Nm consecutive minibatches of one VW; at its end the VW pushes the wave's
#   summed update, which the PS applies at once. A VW's clock (its waves pushed) may lead the slowest
#   VW's by at most **D**, the clock distance bound, when it passes the *gate* before the last minibatch
#   of a wave (by D + 1 at any moment); passing the gate, it pulls the global weights.
#
# This notebook walks through the whole workflow on CPU (it runs in under three minutes on two cores):
#
# 1. describe a heterogeneous cluster;
# 2. let the planner lay out VGG-19 on it (virtual workers, GPU order, cuts, Nm) and read the plan;
# 3. simulate the plan (`sim` executor, no numerics) and read where every GPU-second goes;
# 4. train a model for real on emulated devices (`virtual` executor: real JAX numerics, the emulated
#    cluster's clock);
# 5. check the trace against every WSP guarantee, and see the checker catch a broken trace;
# 6. look at the timeline.
#
# Every emulated GPU is a JAX device; on a CPU host that is one of the host platform's devices, and their
# number is fixed before JAX runs anything. So this comes first:

# %%
import json
import pathlib

import matplotlib.pyplot as plt
from IPython.display import Image, display

import hetpipe_jax as hp
from hetpipe_jax.efficiency import efficiency_report, plot_breakdown
from hetpipe_jax.models import full_size_spec
from hetpipe_jax.viz.timeline import chrome_trace, plot_gantt

hp.ensure_cpu_devices(8)  # before JAX runs anything: 8 CPU devices stand in for the cluster's GPUs (6 below)

OUT = pathlib.Path("outputs/tutorial")  # every file this notebook writes goes here
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. A heterogeneous cluster
#
# A cluster is nodes of GPUs, one link type inside a node and one between nodes. The GPU types come from a
# catalogue (`hetpipe_jax/cluster/catalogue.py`): memory, peak flop rates, memory bandwidth, and an
# efficiency calibrated to published training throughput. Presets exist (`paper_testbed` is the paper's
# 16-GPU testbed, `hetero4` the default of the training script); your own cluster is a TOML file. Here:
# three nodes of two GPUs each, a fast one (TITAN V), a small-memory one (RTX 2060, 6 GB) and a slow one
# (Quadro P4000), PCIe inside a node and 56 Gb/s InfiniBand between nodes.

# %%
(OUT / "lab.toml").write_text("""
name = "lab"
[links]
intra_node = "pcie3"
inter_node = "ib_fdr56"
[[nodes]]
gpus = ["TITAN V", "TITAN V"]
[[nodes]]
gpus = ["RTX 2060", "RTX 2060"]
[[nodes]]
gpus = ["Quadro P4000", "Quadro P4000"]
""")
cluster = hp.get_cluster(str(OUT / "lab.toml"))

print(f"{cluster.name}: {cluster.num_gpus} GPUs on {cluster.num_nodes} nodes; links: "
      f"{cluster.intra_node.name} inside a node, {cluster.inter_node.name} between nodes")
for g in cluster.gpus:
  print(f"  GPU {g.index}  node {g.node}  {g.type.name:13} {g.type.memory_bytes / 2**30:4.0f} GiB "
        f"{g.type.fp32_flops / 1e12:5.1f} TFLOP/s fp32   (device name {g.name})")

# %% [markdown]
# ## 2. Plan VGG-19 on it
#
# The planner answers three questions (docs/PROTOCOL.md, sections 4-5):
#
# * **Which GPUs form a virtual worker** (the allocation policy). `NP`: one VW per node (fast pipelines
#   inside a node, but VWs of very different speeds). `ED`: VW *v* takes the *v*-th GPU of every type, so
#   all VWs are alike. `HD`: the fastest node is paired with the slowest, and each pair is split into
#   VWs of equal shares.
# * **How to cut the model over a VW's GPUs, and in which order.** An exact dynamic program over the cut
#   positions *and* the pipeline order of the GPUs minimises the slowest stage, under every GPU's memory.
#   A stage's time is the roofline time of its units on that GPU type (flops and bytes from XLA's cost
#   analysis of each unit) plus receiving its input over the link.
# * **Nm**, the minibatches in flight. Memory grows with Nm (stashed weight versions and kept activations),
#   so `nm="max_fit"` takes the largest Nm that still fits every stage.
#
# `plan_hetpipe` returns the plan of exactly the run `run_hetpipe` would run with the same arguments,
# without running it. VGG-19 is a full-size model (224x224 ImageNet inputs): it is profiled, planned and
# simulated, never trained here, so its "dataset" is only an input description.

# %%
vgg19 = hp.get_model("vgg19", num_classes=1000)
imagenet = full_size_spec("vgg19")  # 224x224x3 inputs, 1000 classes: a shape, no data
config = hp.RunConfig.of(cluster=cluster, executor="sim", policy="ED", placement="local", nm="max_fit",
                         d=1, waves=40, batch_size=32)
plan = hp.plan_hetpipe(vgg19, imagenet, config)
print(hp.plan_table(plan))

# %% [markdown]
# How to read it. Under ED each virtual worker holds one GPU of every type; the partitioner chose the
# pipeline order and the cuts together. The TITAN V, the fastest GPU, takes the first eight layers: the
# high-resolution convolutions, which dominate both compute and kept activations. The Quadro P4000, the
# slowest, takes only two convolutions. The RTX 2060 takes the rest, including the three fully connected
# layers, which hold most of VGG-19's 144M weights but keep few activations, so they fit its 6 GB. The
# stage times come out close to each other. The *bottleneck* is the slowest stage, and a VW's modelled
# rate is min(1 / bottleneck, Nm / one minibatch's round trip) minibatches per second. The memory column
# shows why Nm stopped where it did: stage 0 is close to the TITAN V's 12 GiB, and each minibatch more in
# flight adds its kept activations. `placement="local"` puts each unit's PS shard on the node that runs
# it in every VW, so a push never crosses the network (0.0 MiB per push).
#
# Each VW's modelled rate, and their sum (the planner's *bound*), leave out WSP waiting, link contention
# and the PS traffic; the simulator puts them in, and the plan's headline figure is the simulator's
# (`plan_hetpipe` simulates the layout in fast mode; `simulate=False` gives the bound alone).

# %% [markdown]
# ## 3. Simulate the plan and read the time breakdown
#
# The `sim` executor runs the same engine as training (the same pipeline schedule, the same WSP push,
# gate and pull, the same trace), but without numerics: each task takes its cost-model time, stage inputs
# travel as flows on shared links (each node's PCIe, each node's network egress and ingress), and pushes
# and pulls move every unit's update between a stage's GPU and its PS shard. It simulates 40 waves of
# VGG-19 on this cluster in a fraction of a second of host time.

# %%
sim = hp.run_hetpipe(vgg19, imagenet, config)
assert not hp.check_trace(sim.events)  # the simulated trace obeys every WSP guarantee too (step 5)
print(f"simulated: {sim.images_per_second:.1f} images/s over {sim.seconds:.2f} s of cluster time "
      f"(planned: {plan['images_per_s']:.1f}; host time {sim.wall_seconds:.2f} s)")

# %% [markdown]
# The simulated rate is below the plan's. To see why, the trace is broken down per GPU: at every moment
# each GPU is in exactly one state, so the shares add up to 1 (`hetpipe_jax/core/breakdown.py`):
# `compute`; `link` (receiving a stage input, charged in series); `bubble` (waiting for the neighbouring
# stage: pipeline fill, drain and imbalance); `window` (stage 0 idle because Nm minibatches are in
# flight); `gate` (the VW is blocked at the WSP gate); `pull` (the global weights are on their way);
# `push` (waiting for its own push to land before the next wave); `done`.
#
# *Efficiency* is the achieved rate over the ideal aggregate: the sum of every GPU's rate training the
# whole model alone, memory ignored. The breakdown reads the trace only, so it works for every executor;
# the cost model (for the compute part of a task and the ideal) is rebuilt from the trace's meta line,
# and a cluster that is not a preset is passed along.

# %%
report = efficiency_report(sim.events, cluster=cluster)
categories = [c for c in report["shares"][0] if any(s[c] > 0.005 for s in report["shares"])]
print(f"{'GPU':20} {'VW.stage':8} " + " ".join(f"{c:>7}" for c in categories))
for device, share in zip(report["devices"], report["shares"]):
  print(f"{device['gpu']:20} {device['vw']:>4}.{device['stage']:<3} "
        + " ".join(f"{share[c]:7.3f}" for c in categories))
print(f"cluster: {report['images_per_sec']:.1f} images/s of an ideal aggregate "
      f"{report['ideal_images_per_sec']:.1f}: efficiency {report['efficiency']:.3f}")
plot_breakdown(report, str(OUT / "sim.efficiency.png"), "VGG-19, ED-local, sim")
display(Image(filename=str(OUT / "sim.efficiency.png")))

# %% [markdown]
# In this run no GPU waits at the WSP gate: under ED the two virtual workers are alike and move in step.
# What holds them back is the pipeline itself: stage 0 spends part of the run in `window` (Nm minibatches
# in flight do not cover a round trip through three stages and their transfers), the slower stages wait
# in `bubble`, and the pulls of the global weights from the shards cost the last stage its share.
#
# **The policies, planned and simulated.** The same two calls compare the allocation policies:

# %%
for policy in ("NP", "ED", "HD"):
  doc = hp.plan_hetpipe(vgg19, imagenet, config.replace(policy=policy))
  run = hp.run_hetpipe(vgg19, imagenet, config.replace(policy=policy))
  vws = ", ".join(f"{len(vw['devices'])} GPUs Nm={vw['nm']} {vw['images_per_s']:.0f}" for vw in doc["vws"])
  print(f"{policy}: planner's bound {doc['bound_images_per_s']:6.1f} images/s, simulated "
        f"{run.images_per_second:6.1f}   (per VW alone: {vws})")

# %% [markdown]
# NP's bound is high, since each node's pipeline is fast inside the node, but it simulates far
# below: its three virtual workers run at very different speeds, and WSP ties them together.
#
# **What D buys, and what it does not.** WSP lets a fast VW run at most D + 1 waves ahead of the
# slowest, so in the long run every VW moves at the slowest one's wave rate. A larger D lets the fast VWs
# absorb jitter and start further ahead, but under NP the throughput stays the slowest VW's (the node of
# Quadros), and the fast VWs spend the difference blocked at the gate. What D does change is how stale
# the weights may be: the global staleness bound is (D + 2) Nm - 2 minibatches. The simulator makes such
# a sweep cheap (a fraction of a second per run):

# %%
ds = [0, 1, 2, 4]
rows = []
for d in ds:
  run = hp.run_hetpipe(vgg19, imagenet, config.replace(policy="NP", nm=2, d=d))
  stats = hp.staleness_stats(run.events)
  gate = [b / stats["run_seconds"] for b in stats["blocked_seconds"]]
  rows.append((run.images_per_second, gate, stats["max_global_staleness"], max(stats["global_bound"])))
  print(f"D={d}: {run.images_per_second:6.1f} images/s; share of the run blocked at the gate per VW "
        f"{', '.join(f'{g:.2f}' for g in gate)}; global staleness max {rows[-1][2]} (bound {rows[-1][3]})")

fig, (ax_rate, ax_stale) = plt.subplots(1, 2, figsize=(10, 3.2))
ax_rate.plot(ds, [r[0] for r in rows], "o-")
ax_rate.set(xlabel="D", ylabel="images/s (simulated)", title="NP: throughput against D", ylim=(0, None),
            xticks=ds)
ax_stale.plot(ds, [r[2] for r in rows], "o-", label="observed max")
ax_stale.plot(ds, [r[3] for r in rows], "k--", label="bound (D+2)Nm-2")
ax_stale.set(xlabel="D", ylabel="minibatches", title="NP: global staleness", xticks=ds)
ax_stale.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Train for real on emulated devices
#
# The `virtual` executor runs real numerics: each stage is a jitted forward, backward and optimizer
# update on its own JAX device (here a CPU device per emulated GPU), activations move between devices,
# and the PS applies each pushed wave with optax. Its clock is the emulated cluster's: a task takes its
# cost-model time on its GPU type plus its input's transfer, so the run is deterministic (same seed,
# same bits) and its images/s are the cluster's, not the laptop's.
#
# VGG-19 at 224x224 is not something to train on a CPU in a notebook, so we train a small CNN on
# scikit-learn's 8x8 digits on **the same layout and the same clock**: `time_model="vgg19"` makes the
# planner lay out VGG-19 (the plan above: the same GPUs per virtual worker, their order and Nm), gives
# the CNN the fastest cuts on those GPUs, and times every task as VGG-19's stage on its GPU. The numbers
# are the small model's; the timeline is the big model's. (With the default `--dataset=auto` the training
# script uses Fashion-MNIST when it is installed.)

# %%
digits = hp.load_dataset("digits")
cnn = hp.get_model("cnn", num_classes=digits.num_classes)
train_config = config.replace(executor="virtual", time_model="vgg19", waves=40, eval_every=5,
                              optimizer="sgd", learning_rate=0.1)
print(hp.plan_table(hp.plan_hetpipe(cnn, digits, train_config)).splitlines()[0])
result = hp.run_hetpipe(cnn, digits, train_config)
final = result.metrics[-1]
print(f"test accuracy {final['test_accuracy']:.3f} after {train_config.waves} waves per virtual worker "
      f"(global clock {final['global_clock']}); {result.images_per_second:.1f} images/s on the emulated "
      f"cluster's clock ({result.seconds:.2f} s); host time {result.wall_seconds:.1f} s")
print(f"stage cuts of the CNN per virtual worker: {result.cuts}")

# %% [markdown]
# Three clocks, three rates for the same layout. The planner's bound counts only the slowest stage and
# the round trip of each VW alone. The `virtual` clock charges every task and stage transfer, and WSP's
# waiting follows from them, but pushes and pulls take no time and links are not shared. The simulator adds
# both, and the plan's headline is the simulator's figure (in fast mode, so close to the 40-wave run's):

# %%
print(f"VGG-19, ED-local on lab: planner's bound {plan['bound_images_per_s']:.1f}, virtual clock "
      f"{result.images_per_second:.1f}, simulated {sim.images_per_second:.1f} images/s "
      f"(the plan's headline: {plan['images_per_s']:.1f})")
assert sim.images_per_second < result.images_per_second <= plan["bound_images_per_s"]

# %% [markdown]
# Each wave's metrics (`vw`, `wave`, `step`, `time`, `train_loss`, and `test_accuracy` where the global
# weights were evaluated, every `eval_every` global clock ticks) are in `result.metrics`:

# %%
fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.2))
for vw in sorted({m["vw"] for m in result.metrics}):
  mine = [m for m in result.metrics if m["vw"] == vw]
  ax_loss.plot([m["time"] for m in mine], [m["train_loss"] for m in mine], label=f"VW {vw}", lw=1)
evals = [m for m in result.metrics if "test_accuracy" in m]
ax_acc.plot([m["time"] for m in evals], [m["test_accuracy"] for m in evals], "o-", color="k")
ax_loss.set(xlabel="emulated time (s, VGG-19's clock)", ylabel="training loss", title="per virtual worker")
ax_acc.set(xlabel="emulated time (s, VGG-19's clock)", ylabel="test accuracy", title="global weights",
           ylim=(0, 1))
ax_loss.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Check the trace
#
# Every run writes an event trace (JSON Lines; `RunConfig.trace_path` or the scripts' `--trace_out` save
# it to a file, `result.events` holds it in memory): a meta line, then `inject`, `fwd`, `bwd`, `complete`,
# `push`, `pull` and `wait` events in causal order. A `fwd` or `bwd` event carries the *version* of the
# weights the task used: `own`, how many of the VW's own minibatch updates they hold, and `glob`, how many
# waves of every VW their global base holds.
#
# `check_trace` replays the trace without trusting any of the code that wrote it and verifies every WSP
# guarantee (docs/PROTOCOL.md, section 3.7): in-order injection within the Nm window, one task at a time
# per device, local staleness <= Nm - 1, every other VW's waves 0 .. w - D - 2 in the weights of a
# minibatch of wave w (and nothing not yet pushed), hence global staleness <= (D + 2) Nm - 2, the gate
# (c_local - c_global <= D at a gated injection), every wave pushed once in clock order, no update lost or
# counted twice by a pull, and weight stashing. It returns the violations: none here. The observed
# staleness reaches its bounds, which are tight.

# %%
violations = hp.check_trace(result.events)
print("trace check:", "OK, every WSP guarantee holds" if not violations else violations[:5])
assert not violations

stats = hp.staleness_stats(result.events)
meta = result.events[0]
print(f"Nm per VW {meta['nm']}, D = {meta['d']}")
print(f"local staleness (own updates a forward misses): observed {stats['local_staleness']}, "
      f"bound Nm - 1 = {stats['local_bound']}")
print(f"global staleness (in the VW's minibatches): observed {stats['global_staleness']}, "
      f"bound (D + 2) Nm - 2 = {stats['global_bound']}")
print(f"clock gap c_local - c_global right after a push: {stats['clock_gap_after_push']} (bound D + 1)")

fig, (ax_local, ax_global) = plt.subplots(1, 2, figsize=(10, 3))
for ax, name, bound in ((ax_local, "local", max(stats["local_bound"])),
                        (ax_global, "global", max(stats["global_bound"]))):
  hist = stats[f"{name}_staleness"]
  ax.bar(list(hist), list(hist.values()), color="#4C72B0")
  ax.axvline(bound + 0.5, color="k", ls="--", label=f"bound {bound}")
  ax.set(xlabel=f"{name} staleness (minibatches)", ylabel="forward passes", xticks=list(hist))
  ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# A checker that never fails proves nothing, so break the trace on purpose: drop virtual worker 1's push
# of wave 2, as if the parameter server had lost it. Every later pull that claims to include that wave,
# and every push after it, is now wrong, and the checker names the line and the rule:

# %%
lost = next(i for i, e in enumerate(result.events) if e["ev"] == "push" and e["vw"] == 1 and e["wave"] == 2)
broken = result.events[:lost] + result.events[lost + 1:]
found = hp.check_trace(broken)
print(f"{len(found)} violations; the first ones:")
for v in found[:4]:
  print(" ", v)
assert found

# %% [markdown]
# The same checks run from the shell on a saved trace (`python -m hetpipe_jax.check TRACE`), and the
# test suite runs them on every training run it makes.
#
# ## 6. The timeline
#
# A Gantt chart of the first waves: one row per device (virtual worker, stage), forward (blue) and
# backward (orange) tasks labelled with their minibatch, and a grey box on a VW's *gate* row while it was
# blocked by WSP (none here: under ED the two virtual workers move in step). Stage 0 injects Nm = 3
# minibatches and then idles until the first one completes: that is the `window` share of the breakdown.
# Once a backward is ready a device runs it first (the 1F1B schedule), and no pipeline flush separates
# the waves.

# %%
plot_gantt(result.events, str(OUT / "timeline.png"), waves=3)
display(Image(filename=str(OUT / "timeline.png")))

(OUT / "timeline.chrome.json").write_text(json.dumps(chrome_trace(result.events)))
print(f"the whole run as a Chrome trace: {OUT / 'timeline.chrome.json'} (open it in ui.perfetto.dev)")

# %% [markdown]
# ## Where next
#
# * The same steps from the shell: `python -m experiments.plan`, `python -m experiments.train`
#   (`--executor=virtual|wall|sim|multiprocess`, `--policy`, `--cluster=lab.toml`), `python -m
#   hetpipe_jax.check TRACE`, `python -m hetpipe_jax.efficiency TRACE`, `python -m hetpipe_jax.timeline
#   TRACE`: see the [README](../README.md).
# * The `wall` executor runs the same stages concurrently on the devices, one host thread each, on the
#   wall clock; `multiprocess` runs one process per node, as on a real cluster.
# * The protocol the code and the checker implement, rule by rule: [docs/PROTOCOL.md](PROTOCOL.md).
# * Searching groupings, cuts, Nm, D and placements for the fastest configuration: `python -m
#   experiments.tune`; the peers (Horovod, heterogeneity-aware data parallelism, synchronous pipelines,
#   local SGD) on the same simulator: `python -m experiments.baseline`.
