"""Per-layer activation treatment: how many repeated layers keep, recompute or offload their activations.

The sharding program (`passes.sharding`) chooses one recompute mode for the whole model,
because a per-layer mode times a per-layer strategy is a product of decisions the integer program
would have to linearise for every group. Once a layout is chosen, though, each layer's share of the
memory and time of every treatment is a constant, and the layers of a transformer are alike, so the
per-layer choice becomes a small problem of counts:

    choose c_sel, c_full, c_off >= 0 with c_sel + c_full + c_off <= L (layers), minimising
        c_sel t_sel + c_full t_full + c_off t_off  (+ R when any layer is treated)
    subject to
        M_rest + A_none - c_sel d_sel - c_full d_full - c_off d_off + P(used modes) <= budget
        c_off A_layer <= host memory left per device

    A_none     activations the layout keeps with nothing recomputed; d_r = (A_none - A_r) / n_r what one
               of the n_r segments of mode r saves; t_r its recompute seconds (its forward again, with
               the resharding it repeats), both the program's own terms evaluated at the layout
    d_off      = A_layer, one layer's saved activations, moved to the host in forward and back in
               backward: t_off = micro-batches x (down + up) over the host link. On an accelerator the
               copies run on a side stream next to the layer's forward and backward (about twice its
               forward), so only what exceeds them is paid; on a CPU device they are plain copies
    R          what leaving the data-parallel program costs (`ShardingProgram.leaving_plain_s`) when any layer is
               treated on a layout that would otherwise run as plain tensors (no tensor axis, stage 0)
    P          the working memory of the treatments used: the largest recomputed segment of each
               recompute mode used (as the program counts it), and one offloaded layer brought back

The counts are enumerated (L <= a few hundred: c_full and c_off in full, c_sel the fewest that fit),
so the answer is exact for this layout; the uniform mode the program solved is one of the points, so
the mix is never predicted slower. It is not a joint optimum with the layout: a layout the program
rejected under a uniform mode might have been better under some mix.

Which layers: offloaded layers first (their activations are read last in backward, leaving the
longest time to bring them back), then fully recomputed, then selectively recomputed; the last
layers keep theirs. `layer_modes` maps each treatment to its layer indices.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.passes.recompute import layer_containers, recompute_segments, segment_layer
from autopar.plan import LAYER_TREATMENTS


def mix_layer_modes(prog, res, *, allow_offload: bool | None = None):
    """`res` (a feasible MeshResult of `prog` at `prog.last_choice`) with the cheapest per-layer treatment.

    Returns `res` unchanged when the model has no single list of repeated layers, when the recompute
    mode is pinned, or when no mix beats the uniform mode. Otherwise a copy whose step time, compute,
    memory and `layer_modes` (treatment -> number of layers) are those of the mix, and whose `recompute`
    is the leanest recompute mode it uses ("none" when it only offloads).
    """
    if not res.feasible or len(prog.recompute_choices) == 1 and prog.recompute_choices[0] != "none":
        return res
    graph = prog.graph.graph
    layers, scale = model_layers(prog.graph)
    if layers < 2:
        return res
    choice = prog.last_choice
    offload = prog.offload is not False if allow_offload is None else allow_offload
    none_acts, _, _ = prog.fixed_activations(choice, "none")
    per: dict[str, tuple[float, float, float, int]] = {}  # treatment -> (saves, seconds, peak, how many layers)
    for mode in prog.recompute_choices:
        if mode == "none":
            continue
        n = round(len(recompute_segments(graph, mode)) * scale)  # segments of the whole model
        acts, peak, seconds = prog.fixed_activations(choice, mode, res.zero_stage)
        if n:
            per[mode] = ((none_acts - acts) / n, seconds / n, peak, min(n, layers))
    host_left = 0.0
    if offload:
        layer_bytes, layer_fwd_s = (v / layers for v in prog.fixed_layer_activations(choice))
        host_left = prog.host_capacity() - res.offload.get("host_bytes_per_device", 0.0)
        if layer_bytes > 0 and host_left >= layer_bytes:
            per["offload"] = (
                layer_bytes,
                _offload_seconds(prog, layer_bytes, layer_fwd_s),
                layer_bytes,
                min(layers, int(host_left // layer_bytes)),
            )
    if not per:
        return res
    uniform_acts = res.memory.get("activations", 0.0) + res.memory.get("recompute", 0.0)
    rest = sum(res.memory.values()) - uniform_acts
    _, _, solved_s = prog.fixed_activations(choice, res.recompute, res.zero_stage)
    # on a layout that otherwise runs as plain tensors, any treatment moves it to the sharded runtime
    plain = prog.comm(res.zero_stage).runs_plain
    # (and its gradient all-reduces no longer overlap backward)
    runtime_s = prog.leaving_plain_s + res.grad_sync_hidden_s if plain else 0.0
    if res.recompute != "none":
        solved_s += runtime_s
    base_s = res.step_time_s - solved_s
    best = _best_counts(per, layers, prog.budget - rest - none_acts)
    if best is None:
        return res
    counts, seconds, saved, peak = best
    if any(counts.values()):
        seconds += runtime_s
    if base_s + seconds >= res.step_time_s * (1 - 1e-9):
        return res
    if res.recompute != "none" and counts.get(res.recompute) == per[res.recompute][3] and len(counts) == 1:
        return res  # the uniform mode itself
    memory = {k: v for k, v in res.memory.items() if k not in ("activations", "recompute")}
    memory["activations"] = none_acts - saved
    if peak:
        memory["recompute"] = peak
    used = [m for m in ("selective", "full") if counts.get(m)]
    copies_s = counts["offload"] * per["offload"][1] if counts.get("offload") else 0.0  # reported as offload
    return dataclasses.replace(
        res,
        step_time_s=base_s + seconds,
        compute_s=res.compute_s - solved_s + seconds - copies_s,
        memory=memory,
        recompute=used[-1] if used else "none",
        recompute_s=seconds - copies_s,
        layer_modes={m: c for m, c in counts.items() if c},
        grad_sync_hidden_s=0.0 if plain else res.grad_sync_hidden_s,  # the sharded one overlaps
        activation_offload=_activation_offload(counts, per),
    )


def _best_counts(per: dict, layers: int, room: float):
    """(counts, seconds, bytes saved, peak) of the cheapest counts that fit `room` (the budget left
    beside keeping every activation), or None. `room` >= 0 means keeping everything fits."""
    full = per.get("full", (0.0, 0.0, 0.0, 0))
    off = per.get("offload", (0.0, 0.0, 0.0, 0))
    sel = per.get("selective", (0.0, 0.0, 0.0, 0))
    best = None
    for c_full in range(full[3] + 1):
        for c_off in range(min(off[3], layers - c_full) + 1):
            fixed_saved = c_full * full[0] + c_off * off[0]
            peak0 = max(full[2] if c_full else 0.0, off[2] if c_off else 0.0)
            c_sel = 0
            if fixed_saved - peak0 < -room:  # selective recompute must make up the rest
                if sel[0] <= 0:
                    continue
                c_sel = math.ceil((-room - fixed_saved + max(peak0, sel[2])) / sel[0] - 1e-9)
                if c_sel > min(sel[3], layers - c_full - c_off):
                    continue
            peak = max(peak0, sel[2] if c_sel else 0.0)
            saved = fixed_saved + c_sel * sel[0]
            if saved - peak < -room - 1e-6:
                continue
            seconds = c_full * full[1] + c_off * off[1] + c_sel * sel[1]
            if best is None or seconds < best[1] * (1 - 1e-12):
                best = ({"offload": c_off, "full": c_full, "selective": c_sel}, seconds, saved, peak)
    if best is not None:
        best = ({k: v for k, v in best[0].items() if v}, *best[1:])
    return best


def _offload_seconds(prog, layer_bytes: float, layer_fwd_s: float) -> float:
    """Seconds one layer's activation offload adds per step: every micro-batch sends them down and back."""
    link = prog.cluster.host_link
    per_mb = layer_bytes / prog.activation_copies
    copy = link.latency_s + per_mb / link.bandwidth_bytes_per_s
    if prog.cluster.device.kind == "cpu":
        return prog.mb * 2 * copy
    fwd = layer_fwd_s / prog.mb
    return prog.mb * (max(0.0, copy - fwd) + max(0.0, copy - 2 * fwd))


def _activation_offload(counts: dict, per: dict) -> dict:
    """Host bytes per device and seconds per step of the offloaded layers' activations (empty: none)."""
    if not counts.get("offload"):
        return {}
    return {
        "layers": counts["offload"],
        "bytes_per_device": counts["offload"] * per["offload"][0],
        "time_s": counts["offload"] * per["offload"][1],
    }


def model_layers(opgraph) -> tuple[int, float]:
    """(repeated layers of the model, model layers per traced layer) for a model with one list of layers;
    (0, 1.0) otherwise. A shortened trace (`OpGraph.repeats`) stands for more layers than it holds."""
    graph = opgraph.graph
    containers = layer_containers(graph)
    if len(containers) != 1:
        return 0, 1.0
    traced = len({segment_layer(graph, seg) for seg in recompute_segments(graph, "full")})
    real = opgraph.repeats.get(next(iter(containers)), (traced, traced))[1]
    return real, real / max(traced, 1)


def layer_indices(counts: dict[str, int], opgraph) -> dict[str, tuple[int, ...]]:
    """Treatment -> layer indices, handed out in `LAYER_TREATMENTS` order from the first layer.

    A layer of a shortened trace's repeated part stands for every model layer past the traced ones."""
    graph = opgraph.graph
    real, _ = model_layers(opgraph)
    traced = sorted({segment_layer(graph, seg) for seg in recompute_segments(graph, "full")})
    layers = list(range(real))
    eligible = {}
    for m in ("selective", "full"):
        ok = {segment_layer(graph, seg) for seg in recompute_segments(graph, m)}
        eligible[m] = set(layers) if real > len(traced) and ok == set(traced) else ok
    out, taken = {}, set()
    for mode in LAYER_TREATMENTS:
        want = counts.get(mode, 0)
        pick = [i for i in layers if i not in taken and (mode == "offload" or i in eligible[mode])][:want]
        if pick:
            out[mode] = tuple(pick)
            taken.update(pick)
    return out
