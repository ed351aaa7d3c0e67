"""The planner as the engine's default: which HardwareProfile to plan with, and the plan for an LLM.

`LLM` (engine/llm.py) calls `engine_plan` before it loads any weight. The plan decides what the
runtime applies: each expert's home tier and the cache (Fiddler §3.4 placement), the dispatch latency
model, and with an accelerator too small for a dense model the ScheInfer slicing rates (r_CC, r_CG,
r_GG) of each layer's MLP with the prompt-token assignment n_g re-solved per prompt length (Eq. 15).
The profile is, in order: EngineConfig.profile (a JSON path or a preset name), the one `tiered
profile` saved in the cache directory, or a quick measurement (~10 s on 2 cores) saved there for
next time.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from tiered import kernels
from tiered.checkpoint.model_config import ModelConfig
from tiered.config import cpu_threads
from tiered.errors import ConfigError
from tiered.hardware import contention, op_time
from tiered.hardware.profile import HardwareProfile, LinearModel, default_profile_path
from tiered.memory import sizes
from tiered.planner.cpu_predict import native_step
from tiered.planner.make import make_plan, settle_gpu_decode
from tiered.planner.plan import Plan
from tiered.quant.int4 import dequantize_rows


def engine_profile(profile: str | None, accelerator=None, progress: Callable[[str], None] | None = None
                   ) -> HardwareProfile:
    """The HardwareProfile the engine plans with.

    Args:
        profile: a HardwareProfile JSON path or a preset name (`tiered profile --presets`); None =
            the cached profile of this machine, measured now (quick run) and cached if there is none
            or if it lacks the GPU while a CUDA accelerator is in use; its bandwidth-bound CPU
            models follow the memory's speed of this moment and its compute-bound ones the cores' (`speed_now`).
        accelerator: the engine's Accelerator (None = CPU only). For the host stand-in, this
            machine's CPU profile (or a given one without GPU keys) is turned into a GPU-shaped one
            (`standin_profile`); a given profile with GPU keys is used as is, to plan as if on
            that machine while the stand-in runs the plan.
        progress: told (one line) when a measurement starts.
    Raises:
        ConfigError: `profile` is neither a readable profile nor a preset.
    """
    from tiered.hardware.presets import PRESETS, get_preset

    measured = profile is None
    if profile is not None:
        if Path(profile).is_file():
            hw = HardwareProfile.load(profile)
        elif profile in PRESETS:
            hw = get_preset(profile)
        else:
            raise ConfigError(f"hardware profile {profile!r} is neither a file nor a preset",
                              "pass a JSON from `tiered profile` or one of: " + ", ".join(PRESETS))
    else:
        hw = _cached_or_measured(cuda=accelerator is not None and not accelerator.is_host, progress=progress)
        hw = speed_now(hw)
    if accelerator is not None and accelerator.is_host and (measured or not op_time.has_device(hw, "gpu")):
        hw = standin_profile(hw, accelerator.link_bandwidth)
    return hw


BANDWIDTH_TOLERANCE = 0.15  # a memory speed within this fraction of the profile's is taken as the same
# a memory speed beyond this factor of the profile's (either way) is read a third time, after a pause, before it
# is followed: on the 2026-11-28 H100 host the probe read 14x slow twice in a row at planning, the plan put
# every miss on the copy engine (18.3 tok/s) and every miss on the CPU then ran 25.7 (priced 2.6): a stall of
# a second, not the memory's speed. VMs' memory speeds seen so far moved within 2x.
BANDWIDTH_SWING = 3.0
SWING_PAUSE_S = 1.0


def speed_now(hw: HardwareProfile) -> HardwareProfile:
    """This machine's profile with its bandwidth-bound CPU models scaled to the memory's speed now (bandwidth_now)
    and its compute-bound ones to the cores' (compute_now): what the engine plans with. The compute check's first
    reading is taken before the memory check and its second after it, whose ~0.35 s spaces them."""
    early = _compute_early(hw)
    return compute_now(bandwidth_now(hw), early)


# a compute speed within this fraction of a key's minutes is taken as the same. Wider than the memory's: on 2 Zen 3
# cores (2026-12-01, ten rounds alternated) readings 1.17-1.27x slower than the keys' minutes priced SmolLM2's bf16
# 512-token TTFT 7% off (median) where the profile as measured priced it 5%; the minutes it is for ran the int4
# kernel 1.4-1.5x slower than the profile's
COMPUTE_TOLERANCE = 0.3
# each of compute_now's readings is the median of this many timings of the probe (~8 ms each): on 2 Zen 3 cores
# (2026-12-01) ComputeProbe took 0.62-0.99 ms from one half-second to the next within one minute
COMPUTE_SAMPLES = 5
COMPUTE_PAUSE_S = 0.3  # between compute_now's two readings where no memory check spaces them (speed_now)
# the compute probe's largest swing across one timing of a key (the profile's meta["compute_probe"]["swing"],
# hardware/profiler.probe_swing: the mean |log| of its change) at which a reading at planning still tells the
# cores' speed of a run: the median readings of consecutive keys (tens of seconds apart) moved 0.5-3% in profiles of
# 2 Sapphire Rapids cores, 0.4-7% of 2 Zen 3 cores (minutes at one speed, then another); 2 Zen 4 cores' probe moved
# 12-15% on average within single timings (three profiles), and a reading predicted the next seconds' speed with a
# correlation of 0.06-0.15 (2026-12-02); four more profiles there read 0.075 (quick), 0.13, 0.11 and 0.145 (full)
COMPUTE_SWING = 0.06
# the memory probe's twin (meta["probe"]["swing"]: the mean |log| of its change between the halves of its samples
# among one GEMV key's, hardware/profiler.probe_swing): the same 2-core Zen 4 VM's memory probe moved 12% between
# consecutive readings 0.19 s apart, a reading predicted the next 1-10 s with a correlation of 0.04-0.19 and erred
# 8-9% where the long-run median erred 2-5% (150 s of readings, 2026-12-02), and in one planner validation run the
# check scaled the all-in-RAM MoE's GEMV keys 1.75x slow before a decode that measured 9.0 ms a token where the
# session's other runs measured 13.4-13.5 (priced 42% off). Its profiles' memory swing: quick 0.072, 0.087 and 0.10,
# full 0.094-0.315 in five (one full profile's probe medians across its keys 0.75-1.39 ms). Halves of a steady
# memory's ~10-ms samples should differ by a few % (not measured on a steady machine yet: profiles before profiler
# 43 keep no samples); the check acts on readings 15% (BANDWIDTH_TOLERANCE) off, which a swing of half that
# makes chance
MEMORY_SWING = 0.06


def _compute_checked(hw: HardwareProfile, swing: bool = True) -> bool:
    """Whether compute_now checks `hw`: a profile with the compute probe's readings whose cores held a speed across
    a key's timing (_swing; not asked with `swing` False), not checked before, the check not turned off."""
    return "0" not in (os.environ.get("TIERED_COMPUTE_CHECK", "1"), os.environ.get("TIERED_BANDWIDTH_CHECK", "1")) \
        and hw.meta.get("cpu_compute_ratios") is None and bool((hw.meta.get("compute_probe") or {}).get("seconds")) \
        and not (swing and _swing(hw, "compute_probe", COMPUTE_SWING) is not None)


def _swing(hw: HardwareProfile, probe: str, limit: float) -> float | None:
    """How far `hw`'s `probe` (meta key: "probe", the memory's; "compute_probe", the cores') moved within single
    timings (its ["swing"], hardware/profiler.probe_swing) where above `limit`, else None (also for profiles
    without one: before profiler 42 / 43). Above it a reading at planning does not tell the speed of the run that
    follows."""
    swing = (hw.meta.get(probe) or {}).get("swing")
    return swing if swing is not None and swing > limit else None


def _noted(hw: HardwareProfile, note: str) -> HardwareProfile:
    """`hw` with `note` in meta["notes"], added once."""
    if note in hw.meta.get("notes", []):
        return hw
    return replace(hw, meta=dict(hw.meta, notes=list(hw.meta.get("notes", [])) + [note]))


def _compute_early(hw: HardwareProfile):
    """compute_now's first reading, taken now: (the probe, its ratios, the contention reading it began with), or
    None where compute_now would not check or the reading failed."""
    if not _compute_checked(hw):
        return None
    from tiered.hardware.profiler import ComputeProbe

    started = contention.start()
    try:
        probe = ComputeProbe()
        ratios = _compute_reading(hw, probe)
    except Exception:  # noqa: BLE001  (no kernels, no memory for the probe: compute_now plans with the profile)
        return None
    return None if ratios is None else (probe, ratios, started)


def compute_now(hw: HardwareProfile, early=None) -> HardwareProfile:
    """This machine's profile with its compute-bound CPU models (hardware/profiler.COMPUTE_KEYS: the row kernels,
    torch's GEMMs and attention, the step's and prefill's code) scaled to the cores' speed now.

    Where the profile timed the compute-speed probe around each such key (hardware/profiler.ComputeProbe,
    meta["compute_probe"]), the probe is read again, twice (each reading the median of COMPUTE_SAMPLES timings,
    ~40 ms; `early`, from _compute_early, is the first where speed_now took it before the memory check, else the
    two are COMPUTE_PAUSE_S apart), and each key whose two readings fall beyond COMPUTE_TOLERANCE of its own
    minutes' on the same side has its per-unit term scaled by the reading nearer its own
    (hardware/profile.scale_compute_keys), slower or faster; a reading beyond BANDWIDTH_SWING of them is taken a
    third time after SWING_PAUSE_S. A VM's cores change speed for minutes with its neighbours, and a profile
    carries the speed of the minutes it was measured in: on 2 Zen 3 cores (2026-12-01) the int4 kernel at
    SmolLM2's widths took 6.5-7.5 ps a multiply-add in one minute and 9.8-11.3 a few minutes later, and SmolLM2's
    default 512-token TTFT 0.67-0.82 s from one minute to the next where a profile of a faster minute priced 0.55.
    Readings taken while other processes took more than contention.CONTENDED_SHARE of the cores are not applied
    (a note says so), nor any where the profile's cores changed speed within one key's timing (_swing: a
    VM whose speed moves from one second to the next; a note says so). TIERED_COMPUTE_CHECK=0 turns the check
    off, as does TIERED_BANDWIDTH_CHECK=0."""
    if not _compute_checked(hw):
        if _compute_checked(hw, swing=False):  # only the cores' swing stops it
            return _noted(hw, f"compute-speed check at planning not applied: the profile's cores changed speed by "
                              f"{hw.meta['compute_probe']['swing']:.0%} on average within one key's timing (about a "
                              "second), so a reading now does not tell a run's speed")
        return hw
    from tiered.hardware.profile import scale_compute_keys

    if early is None:  # the first reading now, the second COMPUTE_PAUSE_S later
        early = _compute_early(hw)
        if early is None:
            return hw
        time.sleep(COMPUTE_PAUSE_S)
    probe, first, reading = early
    ratios, times = None, "twice"
    try:
        second = _compute_reading(hw, probe)
        if second is not None:
            ratios = {k: _agreeing(first[k], second[k], tolerance=COMPUTE_TOLERANCE) for k in first}
            if any(r is not None and _beyond_swing(r) for r in ratios.values()):
                third, times = _read_again(lambda: _compute_reading(hw, probe)), "three times"
                ratios = {k: None if third is None else
                          _agreeing(first[k], second[k], third[k], tolerance=COMPUTE_TOLERANCE) for k in first}
    except Exception:  # noqa: BLE001  (no kernels, no memory for the probe: plan with the profile)
        ratios = None
    ratios = {k: r for k, r in (ratios or {}).items() if r is not None}
    if not ratios:
        return hw
    share = contention.others_share(*reading)
    if share is not None and share > contention.CONTENDED_SHARE:
        return replace(hw, meta=dict(hw.meta, notes=list(hw.meta.get("notes", [])) + [
            f"compute-speed check at planning not applied: other processes took {share:.0%} of the cores while it ran"]))
    slow = statistics.median(ratios.values())
    return scale_compute_keys(hw, ratios, f"the compute-speed probe (the int4 and bf16 row kernels, weights in cache) "
                                          f"timed {times} at planning: {len(ratios)} compute-bound keys scaled to "
                                          f"the speed it found against each key's own minutes (median "
                                          f"{1 / slow:.2f}x the profile's speed)")


def _compute_reading(hw: HardwareProfile, probe) -> dict[str, float] | None:
    """One reading of compute_now: each key's median ratio (hardware/profiler.cpu_compute_ratios) over
    COMPUTE_SAMPLES timings of `probe`, back to back."""
    from tiered.hardware.profiler import cpu_compute_ratios

    samples = []
    for _ in range(COMPUTE_SAMPLES):
        ratios = cpu_compute_ratios(hw, probe)
        if ratios is None:
            return None
        samples.append(ratios)
    return {k: float(statistics.median(r[k] for r in samples)) for k in samples[0]}


def bandwidth_now(hw: HardwareProfile) -> HardwareProfile:
    """This machine's profile with its bandwidth-bound CPU models scaled to the memory's speed now.

    Where the profile timed a memory-speed probe beside each CPU GEMV key (hardware/profiler.Probe,
    meta["probe"]: the bf16 decode kernel from DRAM), the probe is timed again, twice (~0.3 s each), and
    each key whose two readings fall outside BANDWIDTH_TOLERANCE of its own minute's on the same side
    is scaled by the reading nearer it, slower, or faster but no faster than the profile's median minute
    (_at_most_the_median_minutes_speed; hardware/profile.scale_cpu_keys); the other bandwidth-bound keys
    follow the probes' median as below, when slower. A VM's memory speed moves between minutes
    within one profile too: a quick profile of the 2-core EPYC timed gemv/cpu/bf16 at 42 GB/s and a
    minute later gemv_dram/cpu/bf16 at 81, and one ratio for all priced `make run` 27% slow.

    Without probes: two quick reads beyond the last-level cache (hardware/profiler.cpu_bandwidth_ratio)
    against the profile's prediction for them: when both fall outside BANDWIDTH_TOLERANCE on the same
    side, the CPU's bandwidth-bound models are scaled by the reading nearer the profile
    (hardware/profile.scale_cpu_bandwidth: a faster memory moves only the DRAM floors), so that the
    plan's choices and its predicted tokens/s are those of this minute's machine. A VM's bandwidth
    swings with its neighbours (the 2-core EPYC: 25-50 GB/s within an hour), and decode at batch 1
    moves with it: `make run` decoded at 240 tok/s where a profile of a faster minute predicted 303.
    One reading alone is not trusted: the same machine's read flapped between ~45 and ~80 GB/s from
    one minute to the next (2026-11-26), and a single fast reading priced SmolLM2's decode 58% fast.
    Readings taken while other processes took more than contention.CONTENDED_SHARE of the cores time
    the neighbours, not the memory: they are not applied (a note says so). Nor is any reading taken where the
    profile's memory speed changed within single keys' timings (meta["probe"]["swing"] above MEMORY_SWING: a VM
    whose memory speed moves from one second to the next, where the profile's own minutes are the better price;
    a note says so). TIERED_BANDWIDTH_CHECK=0 turns the check off.
    """
    if os.environ.get("TIERED_BANDWIDTH_CHECK", "1") == "0" or hw.meta.get("cpu_bandwidth_ratio") is not None:
        return hw
    swing = _swing(hw, "probe", MEMORY_SWING)
    if swing is not None:  # a reading now tells nothing of the run's memory speed
        return _noted(hw, f"memory-speed check at planning not applied: the profile's memory speed changed by "
                          f"{swing:.0%} on average within one key's timing (under a second), so a reading now does "
                          "not tell a run's speed")
    reading = contention.start()
    scaled = _bandwidth_now(hw)
    share = contention.others_share(*reading)
    if scaled is hw or share is None or share <= contention.CONTENDED_SHARE:
        return scaled
    # the probe's time was the neighbours' as much as the memory's (a 2-core EPYC at the end of a CI run
    # priced a GLM-4.5-Air-shaped GGUF at 4.8 tok/s where it decoded 74.6): plan with the profile's speeds
    return replace(hw, meta=dict(hw.meta, notes=list(hw.meta.get("notes", [])) + [
        f"memory-speed check at planning not applied: other processes took {share:.0%} of the cores while it ran"]))


def _bandwidth_now(hw: HardwareProfile) -> HardwareProfile:
    """`bandwidth_now`'s readings and scaling, `hw` itself where nothing is scaled."""
    from tiered.hardware.profile import scale_cpu_bandwidth, scale_cpu_keys
    from tiered.hardware.profiler import Probe, cpu_bandwidth_ratio, cpu_probe_ratios

    if hw.meta.get("probe") and hw.meta.get("llc_bytes"):
        probe, ratios, times = None, None, "twice"
        try:
            probe = Probe(hw.meta["llc_bytes"])
            first = cpu_probe_ratios(hw, probe)
            second = cpu_probe_ratios(hw, probe) if first is not None else None
            if first is not None and second is not None:
                ratios = {k: _agreeing(first[k], second[k]) for k in first}
                if any(r is not None and _beyond_swing(r) for r in ratios.values()):
                    third, times = _read_again(lambda: cpu_probe_ratios(hw, probe)), "three times"
                    ratios = {k: None if third is None else _agreeing(first[k], second[k], third[k]) for k in first}
        except Exception:  # noqa: BLE001  (no kernels, no memory for the probe: plan with the profile)
            ratios = None
        finally:
            del probe
        if ratios is not None:
            ratios = _at_most_the_median_minutes_speed(hw, {k: r for k, r in ratios.items() if r is not None})
            if ratios:
                keys = len(ratios) - ("*" in ratios)
                rest = (f"; the other bandwidth-bound CPU costs by its median ratio, {1 / ratios['*']:.2f}x the "
                        "profile's speed" if "*" in ratios else "")
                return scale_cpu_keys(hw, ratios, "the memory-speed probe (the bf16 decode kernel from DRAM) "
                                      f"timed {times} at planning: {keys} GEMV keys scaled to the speed it "
                                      f"found against each key's own minute{rest}")
            return hw
    readings = []
    for _ in range(2):
        found = cpu_bandwidth_ratio(hw)
        if found is None or abs(found[0] - 1.0) <= BANDWIDTH_TOLERANCE:
            return hw
        readings.append(found)
    (r1, _), (r2, _) = readings
    if (r1 > 1.0) != (r2 > 1.0):  # one slower, one faster than the profile: no speed to follow
        return hw
    ratio, now = min(readings, key=lambda r: abs(math.log(r[0])))
    if _beyond_swing(ratio):  # a stall rather than the memory's speed? once more, after a pause
        third = _read_again(lambda: cpu_bandwidth_ratio(hw))
        if third is None or _agreeing(r1, r2, third[0]) is None:
            return hw
        ratio, now = min(readings + [third], key=lambda r: abs(math.log(r[0])))
    what = "bandwidth-bound CPU costs" if ratio > 1.0 else "DRAM floors (the kernels keep their measured rates)"
    return scale_cpu_bandwidth(hw, ratio, f"CPU memory read {now / 1e9:.1f} GB/s at planning (twice), {1 / ratio:.2f}x "
                                          f"the profile's: its {what} scaled to match")


def _at_most_the_median_minutes_speed(hw: HardwareProfile, ratios: dict[str, float]) -> dict[str, float]:
    """Probe ratios (cpu_probe_ratios: seconds now / seconds in a key's minute; "*": against the median
    minute) with each faster reading (< 1) capped so that no key is priced faster than the profile's
    median minute would make it: a key measured in a slow minute is brought to that minute's speed, one
    measured at or beyond it, and "*", keep their rates. Ratios then within BANDWIDTH_TOLERANCE of 1
    are dropped (the key kept as measured). Slower readings pass unchanged.

    Why: the probe timed alone at planning (~50 ms after an idle moment) read faster than the minutes of
    a profile timed under load, while the engines ran at the keys' own rates. On the 2-core AMX VM
    (2026-11-29) the probe read 1.3-1.5 ms at planning against 2.2-2.5 ms among the keys' samples; scaled
    by that, the planner validation's SmolLM2 default rows were priced 25-37% fast where the profile as
    measured priced them within 6-21%, and a quick profile's SmolLM2 decode after 32-2048 positions 35%
    fast against within 12%. A key measured in a slower minute than the rest (the 2-core EPYC,
    2026-11-27: gemv/cpu/bf16 at 42 GB/s, gemv_dram a minute later at 81) still follows the median."""
    seconds = (hw.meta.get("probe") or {}).get("seconds") or {}
    median_minute = float(statistics.median(seconds.values())) if seconds else None
    out = {}
    for k, r in ratios.items():
        if r < 1.0:
            floor = median_minute / seconds[k] if median_minute and k in seconds else 1.0
            r = min(1.0, max(r, floor))
        if abs(r - 1.0) > BANDWIDTH_TOLERANCE:
            out[k] = r
    return out


def _agreeing(*readings: float, tolerance: float = BANDWIDTH_TOLERANCE) -> float | None:
    """Of readings of a speed ratio, the one nearest 1 when all lie beyond `tolerance` on the same side of it,
    else None (no speed to follow)."""
    if any(abs(r - 1.0) <= tolerance for r in readings) or len({r > 1.0 for r in readings}) > 1:
        return None
    return min(readings, key=lambda r: abs(math.log(r)))


def _beyond_swing(ratio: float) -> bool:
    """Whether a speed ratio lies beyond BANDWIDTH_SWING of 1, either way."""
    return abs(math.log(ratio)) > math.log(BANDWIDTH_SWING)


def _read_again(read: Callable[[], object]):
    """`read()` after SWING_PAUSE_S seconds: a third reading of a memory speed far from the profile's;
    None where it fails."""
    time.sleep(SWING_PAUSE_S)
    try:
        return read()
    except Exception:  # noqa: BLE001  (no kernels, no memory for the probe: nothing to follow)
        return None


def _cached_or_measured(cuda: bool, progress: Callable[[str], None] | None) -> HardwareProfile:
    from tiered.hardware.profiler import PROFILER_VERSION, SKIP_RETRIES, failed_cpu_keys, profile_machine

    path = default_profile_path()
    previous, why = None, "no current hardware profile of this machine"
    if path.is_file():
        try:
            hw = HardwareProfile.load(path)
            native = kernels.available()
            current = (hw.meta.get("profiler_version") == PROFILER_VERSION  # else measured the old way
                       and hw.meta.get("native_kernels") == native  # ... or with(out) the kernels
                       and (not native or (hw.meta.get("kernels_build") == kernels.build_name()  # ... or others
                                           and hw.meta.get("kernel_tuning") == kernels.tuning())))
            if current and (not cuda or op_time.has_device(hw, "gpu")):
                # one whose CPU timings raised (profiler.failed_cpu_keys): again, SKIP_RETRIES times in a row
                # at most (a machine whose kernels fail every time keeps the last)
                failed = failed_cpu_keys(hw.meta) and int(hw.meta.get("failed_attempts", 1)) < SKIP_RETRIES
                # one measured while other processes took the cores: again once the machine is quiet (a busy
                # machine now would disturb the new one too; a profile kept after RETRIES disturbed tries
                # in a row had priced SmolLM2 at 1.1 tok/s where `make run`, on the quiet machine, ran 389)
                if not failed and (not hw.meta.get("contended") or contention.quiet_now() is not True):
                    return hw
                previous = hw
                why = (f"the cached hardware profile failed to time {', '.join(failed_cpu_keys(hw.meta))}" if failed
                       else f"the cached hardware profile was measured while other processes took "
                            f"{hw.meta['others_share']:.0%} of the cores")
        except ConfigError:
            pass  # unreadable: measure again
    if progress is not None:
        progress(f"{why}: measuring a quick one for the planner, saved to {path} (`tiered profile` makes a full one)")
    hw = profile_machine(quick=True, cuda=cuda, previous=previous)
    try:
        hw.save(path)
    except OSError:
        pass  # a read-only cache directory: plan with it anyway
    return hw


def decisions(plan: Plan) -> tuple:
    """What a plan decided that a decode step runs by: each layer's kind, precision, slice rates and
    expert tiers, the expert cache, the dispatch mode and the formats (not its predicted times, nor
    n_g, a prompt's token split), and the prefill chunk and mixed rows a prompt runs in."""
    return (tuple((l.kind, l.precision, l.r_cc, l.r_cg, l.r_gg, tuple(l.expert_tiers)) for l in plan.layers),
            plan.expert_cache_slots, plan.cache_policy, plan.dispatch_mode, tuple(sorted(plan.dtypes.items())),
            plan.prefill_chunk, plan.mixed_rows)


# the decisions only a prompt runs by (decisions' last two, and the dtypes its attention and FFN compute in)
PROMPT_DTYPES = ("prompt_attention", "prompt_ffn")


def decode_decisions(plan: Plan) -> tuple:
    """What a plan decided that a decode step runs by: `decisions` without those only a prompt runs by (its
    attention's and FFN's dtypes, the prefill chunk, the mixed rows), which a plan made for another prompt length may
    decide otherwise with the same decode step."""
    layers, slots, policy, dispatch, dtypes, _, _ = decisions(plan)
    return layers, slots, policy, dispatch, tuple((k, v) for k, v in dtypes if k not in PROMPT_DTYPES)


def decode_at(plan: Plan, cfg: ModelConfig, profile: HardwareProfile | None, args: dict | None,
              positions: int, batch: bool = False) -> float | None:
    """The plan's decode speed [tokens/s] priced again at `positions` cached positions (a run's mean
    context: its prompt and half its generated tokens), where the plan priced prompt_tokens +
    gen_tokens: make_plan with the arguments that made it (`args`, engine_plan's third value), a
    prompt of positions - 1 tokens and one generated. A decode step's attention grows with its context, so a short run and
    the plan's priced 640 positions differ (SmolLM2 on 2 cores: ~3.3 ms a token after 32 tokens,
    ~4.2 ms after 640).

    `batch`: the plan's kv_slots sequences stepped together at that context (its
    predicted_batch_decode_tokens_per_s: all their tokens/s), not one.

    Returns None where there is nothing to re-price (a plan of the runtime's rules, a replayed or
    FlexGen plan, mixed-precision experts, no profile, no batch figure) or where the plan made for
    that context decides anything differently (another placement would be a prediction for another
    engine; decode_decisions: a plan for a short prompt may attend it in another dtype, or run it as rows, with the
    same decode step: SmolLM2's at 44 positions did, and the default row of planner_validation compared its 2.9 ms
    a token with the plan's own price at 640 positions, 4.4 ms)."""
    again = None if positions < 2 else _priced_at(plan, cfg, profile, args, positions - 1, decode_decisions)
    if again is None:
        return None
    return again.predicted_batch_decode_tokens_per_s if batch else again.predicted_decode_tokens_per_s


def ttft_at(plan: Plan, cfg: ModelConfig, profile: HardwareProfile | None, args: dict | None,
            tokens: int) -> float | None:
    """The plan's TTFT [s] priced again for a `tokens`-token prompt (its predicted_ttft_s is for prompt_tokens),
    as `decode_at` re-prices decode: None where there is nothing to re-price or the plan made for that prompt
    decides anything differently. A prompt past Plan.prefill_chunk is priced chunk by chunk."""
    again = None if tokens < 1 else _priced_at(plan, cfg, profile, args, tokens)
    return None if again is None else again.predicted_ttft_s


def _priced_at(plan: Plan, cfg: ModelConfig, profile: HardwareProfile | None, args: dict | None,
               prompt_tokens: int, same: Callable[[Plan], tuple] = decisions) -> Plan | None:
    """make_plan again with the arguments that made `plan` (engine_plan's third value) for a prompt of
    `prompt_tokens` and one generated token; None where there is nothing to re-price (a plan of the runtime's
    rules, a replayed or FlexGen plan, mixed-precision experts, no profile) or where it decides anything `same`
    compares differently from `plan` (another placement would be a prediction for another engine)."""
    if args is None or profile is None or plan.flexgen or plan.mixed_precision is not None:
        return None
    again = make_plan(cfg, profile, **dict(args, prompt_tokens=prompt_tokens, gen_tokens=1, requests=None, prefixes=None))
    again.dtypes["decode"] = plan.dtypes["decode"]
    return again if same(again) == same(plan) else None


def standin_profile(cpu: HardwareProfile, link_bandwidth: float | None) -> HardwareProfile:
    """A GPU-shaped profile of the host stand-in accelerator (hardware/accelerator.HostAccelerator).

    Its "GPU" is the CPU: gemm/gemv/attn/memory keys of the CPU are copied to the GPU; a launch is
    one executor task hop (runtime/task); an H2D copy is a memcpy, or n / link_bandwidth when the
    link is throttled. Both "devices" share the same cores, so the plan's overlap is optimistic;
    the stand-in exists to run the GPU control paths, not to be fast.
    """
    models = dict(cpu.models)
    for key, m in cpu.models.items():
        if key.startswith(("gemm/cpu/", "gemm_pack/cpu/", "gemv/cpu/", "attn/cpu/")) or key in ("memory/bandwidth/cpu",
                                                                                           "memory/copy/cpu"):
            models[key.replace("/cpu", "/gpu", 1)] = m
    hop = op_time.task_overhead(cpu)
    models["launch/gpu"] = LinearModel(hop, 0.0, None)
    copy = cpu.models.get("memory/copy/cpu") or LinearModel(0.0, 0.0, None)
    models["copy/h2d_pinned"] = (LinearModel(hop, 1.0 / link_bandwidth, None) if link_bandwidth
                                 else LinearModel(hop, copy.beta, copy.r2))
    ram = cpu.cpu_memory or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    meta = dict(cpu.meta, notes=list(cpu.meta.get("notes", [])) + [
        "host stand-in accelerator: its GPU keys are the CPU's; both share the cores"])
    return replace(cpu, name=f"{cpu.name}+host-standin", models=models, gpu_memory=ram, meta=meta)


def engine_plan(cfg: ModelConfig, ec, accelerator, *, model_name: str, max_context: int, weights_format: str,
                decode_format: str, decode_precision: str, popularity=None,
                progress: Callable[[str], None] | None = None,
                experts_format: str | None = None, head_precision: str | None = None,
                embedding_bytes: int | None = None,
                decode_mix: dict | None = None, disk_reads: Callable[[HardwareProfile], HardwareProfile | None] | None = None,
                ) -> tuple[Plan, HardwareProfile | None, dict | None]:
    """The Plan an LLM applies, per EngineConfig.plan: "auto" plans now (latency goal), "off" writes
    the runtime's plain rules into a Plan (planner/rules.py), a path replays a saved plan as is.

    The auto plan uses the engine's budgets, KV-cache room for one `max_context`-token sequence (what
    the runtime reserves), prompt 512 (or half the context) and 128 generated tokens for the
    predicted times, and keeps the user's explicit settings (cache slots, resident cap, cache
    policy, forced dispatch path, staging buffers, read-ahead, threads).

    Args:
        ec: the EngineConfig.
        accelerator: the engine's Accelerator (None = CPU only: the plan is CPU + disk).
        weights_format: format of the loaded weights ("fp32" / "bf16").
        experts_format: storage format of routed experts (quant/experts.py names; None = weights_format).
        decode_format: EngineConfig.decode_weights when decode copies are installed, else "none".
        decode_precision: the format most decode-copy bytes have ("int4", "int8", "bf16", "fp32").
        head_precision: the lm_head decode copy's format (quant/linear.head_precision), or None.
        embedding_bytes: the token embedding's bytes in its file's blocks when it is block-quantized
            (a GGUF file's), or None: the CPU's one-copy mode keeps it so (make_plan).
        decode_mix: the decode copies' precisions by share of the layers' projection elements where
            they mix (quant/linear.decode_mix), or None.
        popularity: float [L, E] tokens routed per expert, or None.
        disk_reads: when this machine's own profile plans ("auto", no EngineConfig.profile) and the
            plan reads experts from disk: the profile with its disk reads timed on the files the
            experts would be read from (hardware/disk_reads), or None to keep it; the plan is then
            made again with it.
    Returns:
        (plan, the HardwareProfile it was made with, or None for rules / replayed plans, the make_plan
        arguments that made it, or None likewise: `decode_at` prices it again at a run's context).
    Raises:
        BudgetError: the budgets cannot hold what must stay on the fast tier.
        ConfigError: an unreadable plan or profile.
    """
    if ec.plan not in ("auto", "off"):
        return replayed_plan(ec, cfg), None, None
    dense_copies = not one_copy(ec, accelerator, decode_format, cfg, weights_format, decode_precision)
    plan, profile, args = _auto_or_rules(cfg, ec, accelerator, model_name=model_name, max_context=max_context,
                                   weights_format=weights_format, decode_format=decode_format,
                                   decode_precision=decode_precision, popularity=popularity, progress=progress,
                                   experts_format=experts_format, dense_copies=dense_copies,
                                   head_precision=head_precision, decode_mix=decode_mix, disk_reads=disk_reads,
                                   embedding_bytes=embedding_bytes if not dense_copies else None)
    # without an accelerator every decode step runs on the CPU: through the lean step
    plan.cpu_decode_step = accelerator is None
    # ... and in C++ when tiered/kernels is built (setup builds it; TIERED_NATIVE=0 turns it off)
    plan.native_decode = plan.cpu_decode_step and kernels.available()
    priced_native = profile is not None and native_step(profile)
    if profile is not None and priced_native != kernels.available():
        # this machine's own profile is measured again when its kernels come or go (_cached_or_measured):
        # only a given profile (--profile) can price the other path; say so rather than hide it
        plan.notes.append(f"the hardware profile was measured {'with' if priced_native else 'without'} tiered's "
                          f"native kernels and this process runs {'without' if priced_native else 'with'} them: "
                          "the predicted times price the profile's path, not the one that runs")
    # ... where a lone sequence decodes several tokens a native call (LLM._burst; priced by cpu_predict's bursts)
    plan.decode_bursts = plan.native_decode
    # prompts admitted together prefill a shared prefix once, where the followers' extra forward moves no weights
    plan.shared_prefixes = plan.weights_stay_put()
    # int4 decode copies (CPU-only) in the layout of tiered's own kernels when they are built
    plan.int4_layout = "tiled" if kernels.available() else "cpu"
    # int4 activations (Plan.batch_act, Plan.expert_act): made with the plan (make_plan's arguments, or the
    # rules' in _auto_or_rules), so that the plan prices what it decides
    plan.pinned = pinned_memory(ec, plan)
    plan.device_issue = "worker" if ec.device_issue == "worker" else "thread"
    return plan, profile, args


def graphs_allowed(ec, accelerator) -> bool:
    """EngineConfig.graphs on this accelerator: "auto" graphs decode steps on a real GPU, "on" on the
    host stand-in too, "off" never; never without an accelerator."""
    return accelerator is not None and (ec.graphs == "on" or (ec.graphs == "auto" and not accelerator.is_host))


def pinned_memory(ec, plan: Plan) -> str:
    """How a CUDA accelerator pins the weights the plan keeps in RAM (EngineConfig.pinned; "auto":
    "cuda" where dense FFNs are sliced, else "huge").

    Measured on the H100's host (2026-11-26, benchmarks/results/gpu/2026-11-26-h100/call1, one run
    each of the graphs stage and the full table): the dense default plan (sliced) decoded at 28.9 and
    28.9 tok/s with its CC and CG slices in cudaHostAlloc memory against 21.3 and 19.1 in registered
    huge pages; the MoE default plan at 114.0 and 140.9 tok/s in huge pages against 105.8 and 110.7,
    and loaded in 3.8 s against 10.3 (cudaHostAlloc of 11 GiB of experts).
    """
    if ec.pinned != "auto":
        return ec.pinned
    return "cuda" if plan.sliced_layers() else "huge"


def batch_activations(ec, cfg: ModelConfig) -> str:
    """Plan.batch_act for EngineConfig.batch_activations: "auto" is int8 ("q8"), as llama.cpp computes
    every multi-row matmul: a server's batches, MoE prompts (mostly routed experts: 1.7x faster in
    int8) and one sequence's prompt rows alike. 2 Sapphire Rapids cores (2026-11-29), TTFT of prompts
    run as native-step rows, bf16 against int8 activations: SmolLM2 at 16 / 32 / 96 tokens 27 / 51 /
    203 ms (96: past bf16's mixed rows) against 14 / 21 / 61; a Llama-3-8B-width Q4_K_M file (8 layers)
    at 16 / 32 / 48 396 / 717 / 1104 against 164 / 273 / 414 ms (llama.cpp at 32: 561). The rounding
    costs SmolLM2 ~0.001 nats of next-token KL to lossless (0.0014-0.0018 with bf16 prompt rows,
    0.0025-0.0028 with int8: three chat prompts, 2026-11-23); "bf16" keeps the batch-1 numerics."""
    return "q8" if ec.batch_activations == "auto" else ec.batch_activations


def expert_activations(ec) -> str:
    """Plan.expert_act for EngineConfig.expert_activations: "auto" is int8 ("q8"): routed int4 experts at
    batch 1 on half the multiply-adds (an OLMoE-width int4 expert from cache on 2 Zen 4 cores: 91-96 GB/s
    on int8 x against 45 on bf16 x with AVX-512, 71 against 31-50 on int16 x with AVX2)."""
    return "q8" if ec.expert_activations == "auto" else ec.expert_activations


# Most rows of a mixed prefill + decode step, by the kernels' ISA and Plan.batch_act: below the
# prompt length where the modules' prefill (a dequantized GEMM) overtakes rows of the native step.
# SmolLM2 int4, 2 cores, a prompt of 16 / 32 / 64 / 96 / 128 / 192 tokens:
#   AVX-512 (Xeon): 21-23 / 41 / 86 / 130 / 180-188 / 270-304 ms as rows on int8 activations,
#     33 / 66 / 137 / 212 / 273 / 448 ms on bf16 ones, 50 / 94 / 140 / 165 / 193 / 278 ms prefill;
#   AVX2 (EPYC, no AVX-512: fp32 GEMMs): 27 / 52 / 96 / 191 / 219 / 330-371 ms as rows on int8,
#     32 / 59 / 116 / 180 / 238 / 378 on int16, 46-50 / 72-80 / 218-283 / 259-343 / 322-397 /
#     416-503 ms prefill; at 256 tokens 575 (int8 rows) against 565 ms, at 512 1243 against 1082.
MIXED_ROWS = {"avx512": {"q8": 96, "bf16": 48}, "avx2": {"q8": 192, "bf16": 192}}
# ... and on AVX-512 where the kernel tuning found that int8 prompt rows never dequantize (quant/int4.dequantize_rows
# None: the modules' prefill runs the same int4 kernels): on 2 Zen 5 cores (2026-12-01, `/tmp/s54/mixed.py`) a
# SmolLM2 prompt as rows of the native step took 0.66-0.75x the modules' prefill at 64 / 96 / 128 / 192 / 256 /
# 384 / 512 / 768 / 1024 tokens (36 against 51 ms at 128, 86 against 126 at 256, 491 against 684 at 1024). Kept
# at 256: AVX2's rows had lost from there (575 against 565 ms at 256, 1243 against 1082 at 512, its modules'
# prefill then dequantizing). Past this floor the plan prices both paths (latency_cpu.priced_mixed_rows), which
# on 2 Zen 3 cores with undequantized rows (2026-12-01) extends AVX2's 192 to 1024, measured right there.
MIXED_ROWS_UNDEQUANTIZED = 256


# prompt rows of 16-bit weights (bf16 / fp16: the native step's bf16 row kernel, ~10 ps a multiply-add on 2 AMX cores)
# where the CPU has a bf16 GEMM of its own (oneDNN on AVX-512 BF16 / AMX: ~1 ps): on 2 Sapphire Rapids cores
# (2026-12-02, medians of 3, alternated) SmolLM2 in bf16 took 18 / 29 / 50 / 88 / 128 ms as rows at 8 / 16 / 32 / 64
# / 96 tokens against 29 / 30 / 33 / 42 / 50 through the modules, and the 8-layer Mixtral-width bf16 dummy 58 / 76 /
# 95 / 118 / 261 ms at 8 / 16 / 24 / 32 / 64 against 64 / 80 / 92 / 96 / 124: the MIXED_ROWS tables (int4 rows on
# int8 activations) had run both as rows up to 96 tokens
MIXED_ROWS_BF16_GEMM = 16


def planned_mixed_rows(cfg: ModelConfig, accelerator, batch_act: str, rows_format: str | None = None) -> int:
    """Plan.mixed_rows of an engine on this machine: `mixed_rows` for its kernels' ISA, `batch_act` and where its
    int8 prompt rows dequantize (quant/int4.dequantize_rows("q8")) when it decodes on the CPU in the native step
    (no accelerator, tiered/kernels built: Plan.native_decode); 0 otherwise. MoE models too: the step runs a
    prompt's rows through its MoE blocks (or their modules) as a prefill does, grouped by expert, and their
    attention natively. On 2 Zen 3 cores (2026-12-01, the Qwen3-30B-A3B-width 8-layer Q4_0 file, alternated) a
    prompt as rows took 0.80-0.97x the modules' prefill at 16-512 tokens (171 against 215 ms at 32, 3.19 against
    3.57 s at 512), the same first tokens. `rows_format`: the format the step's projections hold (its decode
    copies', else the weights'): bf16 / fp16 ones on a CPU with a bf16 GEMM (hardware/cpu_gemm.bf16_gemm_native)
    join as rows up to MIXED_ROWS_BF16_GEMM tokens at most."""
    if accelerator is not None or not kernels.available():
        return 0
    rows = mixed_rows(kernels.isa(), batch_act, dequantize_rows("q8"))
    if rows_format in ("bf16", "fp16"):
        from tiered.hardware.cpu_gemm import bf16_gemm_native

        if bf16_gemm_native():
            rows = min(rows, MIXED_ROWS_BF16_GEMM)
    return rows


def mixed_rows(isa: str | None, batch_act: str, dequantize: int | None = 0) -> int:
    """Plan.mixed_rows for the native kernels' ISA path ("avx512", "avx2", "scalar"; None: no
    kernels, so no native step to join) and Plan.batch_act ("q8" or "bf16"): rows, 0 for none.
    The scalar path takes AVX-512's (smaller) limits. `dequantize`: the rows past which the machine's int4
    prompt rows on int8 activations dequantize (quant/int4.dequantize_rows("q8"); None: never), which on
    AVX-512 lifts its q8 limit to MIXED_ROWS_UNDEQUANTIZED."""
    if isa is None:
        return 0
    if isa == "avx512" and batch_act == "q8" and dequantize is None:
        return MIXED_ROWS_UNDEQUANTIZED
    return MIXED_ROWS.get(isa, MIXED_ROWS["avx512"])[batch_act]


def compact_cpu_decode(ec, accelerator, decode_format: str) -> bool:
    """Whether the engine decodes on the CPU from compact (lossy) copies: no accelerator, `--dtype`
    left to the engine, decode copies other than fp32 (`--dtype float32 --decode-weights fp32` is the
    lossless mode). Its weights then keep one copy (`one_copy`) and bf16 / fp16 experts stay 16-bit
    (LLM._experts_format)."""
    return accelerator is None and ec.dtype == "auto" and decode_format not in ("none", "fp32")


def one_copy(ec, accelerator, decode_format: str, cfg: ModelConfig, weights_format: str, decode_precision: str) -> bool:
    """Whether each weight keeps one copy, its decode copy (Plan.dense_copies False).

    On the CPU with compact decode copies, unless `--dtype float32` asks for the lossless mode:
    for one sequence at a time (`run`, `chat`), memory first; for a server's batches
    (max_batch > 1) too when tiered/kernels is built, since short prompts then run as rows of the
    native decode step (Plan.mixed_rows) and longer ones dequantize for one GEMM. In-process
    closed loop of 32 SmolLM2 chat clients (2 cores, two runs each): 309-362 tok/s with one copy,
    306-329 with the fp32 copies beside it (540 MB more). Without the kernels a server's prefills
    would run on torch's packed int4 kernels, so it keeps the dense weights unless the RAM budget
    cannot hold them beside the copies.
    """
    if not compact_cpu_decode(ec, accelerator, decode_format):
        return False
    if (ec.max_batch == 1 and ec.goal == "latency") or kernels.available():
        return True
    both = sizes.weight_bytes(cfg, weights_format) + sizes.weight_bytes(cfg, decode_precision)
    return ec.cpu_memory is not None and both > ec.cpu_memory


def speculation(ec) -> dict:
    """make_plan's speculative-decoding arguments from EngineConfig `ec` (speculative, speculative_tokens,
    prompt_lookup)."""
    return dict(speculative=ec.speculative, speculative_tokens=ec.num_speculative_tokens,
                prompt_lookup=(ec.prompt_lookup_min, ec.prompt_lookup_max))


def replayed_plan(ec, cfg: ModelConfig) -> Plan:
    """The saved plan EngineConfig.plan names, checked against the model (Plan.check_model). Settings the
    plan decides cannot also be given: an explicit cache size, resident cap, cache policy or prefetch
    that differs from the plan's is refused rather than silently replaced by the plan's.

    Raises:
        ConfigError: the file is unreadable, made for another model, or contradicted by the settings.
    """
    plan = Plan.load(ec.plan)
    plan.check_model(cfg)
    given = [(flag, value, mine) for flag, value, mine in (
        ("--cache-slots", ec.expert_cache_slots, plan.expert_cache_slots),
        ("--cache-policy", ec.cache_policy if ec.cache_policy != "lru" else None, plan.cache_policy),
        ("--prefetch", True if ec.prefetch else None, plan.prefetch),
        ("--speculative", ec.speculative if ec.speculative != "off" else None, plan.speculative),
        ("resident_experts", ec.resident_experts, None)) if value is not None and value != mine]
    if given:
        flag, value, mine = given[0]
        raise ConfigError(f"{flag} {value} contradicts the replayed plan {ec.plan}"
                          + (f" (which has {mine})" if mine is not None else ""),
                          "a replayed plan keeps its own decisions: edit the file, or plan anew without --plan")
    return plan


def _auto_or_rules(cfg: ModelConfig, ec, accelerator, *, model_name: str, max_context: int, weights_format: str,
                   decode_format: str, decode_precision: str, popularity=None,
                   progress: Callable[[str], None] | None = None, experts_format: str | None = None,
                   dense_copies: bool = True, head_precision: str | None = None, embedding_bytes: int | None = None,
                   decode_mix: dict | None = None,
                   disk_reads: Callable[[HardwareProfile], HardwareProfile | None] | None = None,
                   ) -> tuple[Plan, HardwareProfile | None, dict | None]:
    """engine_plan's "auto" (the planner) and "off" (the runtime's rules) cases: (plan, profile, make_plan's
    arguments), the last two None for the rules."""
    gpu = accelerator.budget.capacity if accelerator is not None else None
    step_format = decode_precision if decode_format != "none" else weights_format  # what the native step's rows run
    if ec.plan == "off":
        from tiered.planner.rules import rules_plan
        plan = rules_plan(cfg, ec, accelerator, model_name=model_name, max_context=max_context,
                          weights_format=weights_format, popularity=popularity, experts_format=experts_format,
                          decode_precision=decode_precision if decode_format != "none" else None)
        plan.dtypes["decode"], plan.dense_copies = decode_format, dense_copies
        plan.prefetch, plan.prefetch_lookahead = ec.prefetch and cfg.is_moe, ec.prefetch_lookahead
        plan.batch_act, plan.expert_act = batch_activations(ec, cfg), expert_activations(ec)
        plan.mixed_rows = planned_mixed_rows(cfg, accelerator, plan.batch_act, step_format)
        spec = speculation(ec)
        plan.speculative, plan.prompt_lookup = spec["speculative"], list(spec["prompt_lookup"])
        plan.speculative_tokens = spec["speculative_tokens"] if plan.speculative != "off" else 0
        # its decode steps as CUDA graphs, as make_plan settles an auto plan's (a model wholly on
        # the GPU as one graph, an offloading plan with attention on the GPU piecewise)
        return settle_gpu_decode(plan, cfg, graphs_allowed(ec, accelerator)), None, None
    profile = engine_profile(ec.profile, accelerator, progress=progress)
    if accelerator is None:  # no GPU tier: make_plan then plans CPU + disk
        profile = replace(profile, gpu_memory=None)
    prompt = max(1, min(512, max_context // 2))
    gen = max(1, min(128, max_context - prompt))
    if ec.goal == "throughput":  # the requests' lengths the batch is priced on (FlexGen's 512 + 32 by default)
        want_prompt, want_gen = ec.workload or ec.request_means() or (512, 32)
        # within max_context: the generated tokens up to half of it (what batching speeds up), the prompt the rest
        # (a 256-token context had priced (255, 1): a prefill that batching barely helps)
        gen = max(1, min(want_gen, max_context // 2))
        prompt = max(1, min(want_prompt, max_context - gen))
    # CPU-only with decode copies: the non-expert weights are read (and, in one-copy mode, held) in
    # the copies' format, MoE models included (their experts are priced in their own format)
    dense_cpu = accelerator is None and decode_format != "none"
    batch_act = batch_activations(ec, cfg)
    args = dict(model_name=model_name, gpu_memory=gpu, cpu_memory=ec.cpu_memory, goal="latency",
                prompt_tokens=prompt, gen_tokens=gen,
                precision=decode_precision if dense_cpu else weights_format, weights_format=weights_format,
                context_tokens=max_context, popularity=popularity, expert_cache_slots=ec.expert_cache_slots,
                max_resident=ec.resident_experts, cache_policy=ec.cache_policy,
                dispatch_mode=ec.force_expert_path or "balanced", staging_buffers=ec.staging_buffers,
                read_ahead=ec.read_ahead,
                dense_copies=dense_copies,
                experts_format=experts_format, kv_slots=ec.max_batch,
                head_precision=head_precision if dense_cpu else None, embedding_bytes=embedding_bytes,
                expert_act=expert_activations(ec), batch_act=batch_act,
                graphs=graphs_allowed(ec, accelerator), prefetch=ec.prefetch,
                prefetch_lookahead=ec.prefetch_lookahead, precision_mix=decode_mix if dense_cpu else None,
                mixed_rows=planned_mixed_rows(cfg, accelerator, batch_act, step_format),
                **speculation(ec), kv_cache=ec.kv_cache_dtype, sliding_kv=ec.sliding_kv,
                requests=ec.requests if ec.goal == "throughput" else None,
                prefixes=ec.request_prefixes if ec.goal == "throughput" else None,
                workspace=None if accelerator is None else
                sizes.device_workspace_bytes(cfg, weights_format, accelerator.library_workspace_bytes()))

    def planned(profile: HardwareProfile) -> Plan:
        """The latency goal's plan, or the throughput goal's batch of such plans (throughput.plan_batch)."""
        if ec.goal != "throughput":
            return make_plan(cfg, profile, **args)
        from tiered.planner.throughput import plan_batch
        int8 = (lambda B: make_plan(cfg, profile, **dict(args, kv_slots=B, kv_cache="int8"))) \
            if ec.kv_cache_dtype == "auto" and not cfg.is_mla and accelerator is None else None
        return plan_batch(lambda B: make_plan(cfg, profile, **dict(args, kv_slots=B)), ec.max_batch, int8,
                          ec.lone_decode_share)

    plan = planned(profile)
    if disk_reads is not None and ec.profile is None and any(l.experts_disk for l in plan.layers):
        fitted = disk_reads(profile)  # the disk the experts live on, not the profiler's temp file
        if fitted is not None:
            said = fitted.meta.get("notes", [])[len(profile.meta.get("notes", [])):]  # what the fit says of itself
            profile = fitted
            plan = planned(profile)
            plan.notes.extend(said)
    plan.dtypes["decode"] = decode_format
    plan.cpu_threads = cpu_threads(ec)
    ratio = profile.meta.get("cpu_bandwidth_ratio")
    keys = profile.meta.get("cpu_key_ratios")
    if keys:
        moved = ", ".join(f"{k} x{r:.2f}" for k, r in sorted(keys.items()) if k != "*")
        plan.notes.append("the memory-speed probe differed from the profile's minutes at planning; scaled to "
                          f"match: {moved or 'no GEMV key'}" + (f", other bandwidth-bound costs x{ratio:.2f}"
                                                              if "*" in keys else ""))
    elif ratio is not None:
        plan.notes.append(f"the CPU's memory ran {1 / ratio:.2f}x the profile's speed at planning; its "
                          "bandwidth-bound costs were scaled to match")
    return plan, profile, args


def token_assignment(plan: Plan, cfg: ModelConfig, profile: HardwareProfile | None) -> Callable[[int, int], int]:
    """n_g(layer, T): prompt tokens of a T-token step whose CC part runs on the GPU (CG' path).

    With the profile, ScheInfer Eq. 15 is solved for each (layer, T) as it comes (memoized); a
    replayed plan without its profile scales the planned n_g by T / planned prompt length.
    """
    from functools import lru_cache

    from tiered.planner.cost_model import LayerShape, SliceRates, cost_params
    from tiered.planner.scheinfer import solve_n_g

    layers = {l.layer: l for l in plan.layers}
    bpe = op_time.bytes_per_element(plan.dtypes.get("weights", plan.precision))

    @lru_cache(maxsize=4096)
    def n_g(layer: int, T: int) -> int:
        l = layers.get(layer)
        if l is None or l.r_cc <= 0:
            return 0
        if profile is None:
            return int(round(l.n_g * T / max(plan.prompt_tokens, 1)))
        shape = LayerShape(T, cfg.hidden_size, cfg.intermediate_size, 3, bpe)
        rates = SliceRates(l.r_cc, l.r_cg, max(0.0, 1.0 - l.r_cc - l.r_cg))
        return solve_n_g(shape, rates, cost_params(profile, plan.dtypes.get("weights", plan.precision), shape)).n_g

    return n_g
