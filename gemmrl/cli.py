"""The command line: a thin layer over the pipeline's stages."""

from __future__ import annotations

import dataclasses
import json
import os
import math
import sys
import time
from collections import Counter
from pathlib import Path

import click
from click.core import ParameterSource

# kernel mode's precision target, bench's default: defined with the statistics it is on
from gemmrl.bench.stats import KERNEL_CI, KERNEL_MAX_ROUNDS, KERNEL_MAX_S, kernel_precision  # noqa: F401
from gemmrl.build.slices import build_plans, compile_then_time, cut_slices, time_in_slices, unbuilt_counts
from gemmrl.core.problem import ProblemError
from gemmrl.core import shapes as shapes_mod

DEFAULT_DB = os.environ.get("GEMMRL_DB", "results/gemmrl.sqlite")
MODES = ("kernel", "offline", "server")


def _layouts(text: str) -> tuple[str, ...]:
    lays = tuple(x.strip().upper() for x in text.split(",") if x.strip())
    if not lays or any(x not in ("NN", "TN") for x in lays):
        raise click.BadParameter("layouts are NN and/or TN", param_hint="--layouts")
    return lays


def _problems(spec: str, dtype: str, acc: str):
    try:
        return shapes_mod.resolve(spec, dtype, acc)
    except ProblemError as e:
        raise click.BadParameter(str(e), param_hint="--shapes") from None


def _check_run_exists(db: str, run_id: int, hint: str) -> None:
    """A BadParameter unless the store at `db` (or its committed .xz) holds run `run_id`: a run
    number past the store's last is a typo that would silently mean every run."""
    from gemmrl.store.db import Store, packed_path, unpack_if_missing

    unpack_if_missing(db)
    if not Path(db).exists():
        raise click.BadParameter(f"no store at {db} (nor {packed_path(db)}), so no run {run_id}", param_hint=hint)
    store = Store(db, readonly=True)
    try:
        last = store.db.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0]
    finally:
        store.close()
    if run_id > last:
        raise click.BadParameter(f"the store {db} has no run {run_id} (its last is {last})", param_hint=hint)


def _modes(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for v in values:
        for m in v.split(","):
            m = m.strip()
            if m == "all":
                out += [x for x in MODES if x not in out]
            elif m in MODES:
                if m not in out:
                    out.append(m)
            else:
                raise click.BadParameter(f"unknown mode {m!r}; use kernel, offline, server or all",
                                         param_hint="--mode")
    return tuple(out)


def build_impls(specs: tuple[str, ...], store=None, device: str = "", include_dirs=()):
    from gemmrl.bench.select import impls_from_specs

    try:
        return impls_from_specs(specs, store, device, include_dirs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--impl") from None


class _Main(click.Group):
    """The CLI's group: a missing compiler or header set (build.toolchain.ToolchainMissing), found
    before a run or in the middle of one, ends the command with what to install, not a traceback."""

    def invoke(self, ctx):
        from gemmrl.build.toolchain import ToolchainMissing

        try:
            return super().invoke(ctx)
        except ToolchainMissing as e:
            raise click.ClickException(f"{e} (nothing was recorded against the kernels; install it and run "
                                       "the command again)") from None


@click.group(cls=_Main)
@click.version_option(package_name="gemmrl")
def main():
    """gemmrl: verify and time HGEMM kernels against NVIDIA's libraries, and keep the fastest."""
    stop_cleanly_on_sigterm()


def _cublas_version() -> str:
    """The cuBLAS / cuBLASLt versions a run's provenance records (a pack's cuBLASLt algorithms are
    valid for the version they were chosen under), or why they are unknown."""
    try:
        from gemmrl.baselines.impls import cublas_lib

        return cublas_lib().version()
    except Exception as e:  # the report says so; torch.matmul still runs
        return f"unavailable: {e}"[:200]


def stop_cleanly_on_sigterm() -> None:
    """`timeout`, batch schedulers and a `--gpus` parent stop a run with SIGTERM, which by default
    ends Python at once: make it a SystemExit instead, so the run's finally blocks still run (the
    store records the run as partial and closes, isolated workers are stopped). Only from the
    main thread, and only where nobody set a handler already."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)


@main.command()
@click.option("--shapes", "shape_spec", default="subset", show_default=True,
              help="grid | subset | subset:N | FILE | MxNxK[,MxNxK...]")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--below", default=None, type=float,
              help="with --shapes SPEEDUP.csv (a report's): only the shapes whose --column is below this, worst first")
@click.option("--column", default="cuBLASLt-auto-tuning-max", show_default=True)
@click.option("--plain", is_flag=True, help="shapes only, one per line (a shape file)")
def shapes(shape_spec, dtype, acc, below, column, plain):
    """List the shapes a --shapes value means (no GPU needed)."""
    if below is not None:
        try:
            problems = shapes_mod.shapes_below(shape_spec, column, below, dtype, acc)
        except ProblemError as e:
            raise click.BadParameter(str(e), param_hint="--shapes") from None
    else:
        problems = _problems(shape_spec, dtype, acc)
    for p in problems:
        click.echo(p.shape if plain else f"{p.shape}\t{p.flops:.3e} FLOPs")


# The judge's host-timing precision (offline and server modes): sample until the median (server
# mode: each paired ratio) is known to within 0.5%, or for at most this many seconds per shape. On
# an H200 two timings of one implementation then agreed within 2% on all 32 shapes of a test set
# offline in three runs, and in server mode with 12 s (results/README.md, third to fifth sessions).
HOST_CI = 0.005
HOST_MAX_S = {"offline": 5.0, "server": 12.0}
# rounds a second the round cap allows, so that the time cap is what binds: offline rounds of
# small shapes take well under a millisecond (a 2,000-round cap stopped 18 of 32 H100 shapes short
# of the target, and the four whose two timings differed by 1.3-3.4% were among them); a server
# round waits a millisecond's idle gap per implementation
HOST_ROUNDS_PER_S = {"offline": 4000, "server": 200}


def host_precision(mode: str, quick: bool, host_ci: float | None, host_max_s: float | None) -> dict:
    """HostSettings fields for `bench`'s offline or server timing: the precision target unless
    --quick (v2: fixed rounds; server mode at most 100); the round cap allows HOST_ROUNDS_PER_S
    of the time cap, at least 2,000."""
    if quick:
        return {} if mode == "offline" else {"max_rounds": 100}
    max_s = HOST_MAX_S[mode] if host_max_s is None else host_max_s
    return {"target_ci": HOST_CI if host_ci is None else host_ci,
            "max_rounds": max(2000, math.ceil(HOST_ROUNDS_PER_S[mode] * max_s)), "max_s": max_s}


@main.command()
@click.option("--shapes", "shape_spec", default="subset", show_default=True,
              help="grid | subset | subset:N | FILE | MxNxK[,MxNxK...]")
@click.option("--mode", "mode_opts", multiple=True, default=("kernel",), show_default=True,
              help="kernel, offline, server or all (repeat or comma-separate)")
@click.option("--impl", "impl_opts", multiple=True, default=("baselines",), show_default=True,
              help="baselines | exhaustive | torch.compile | <baseline name> | cuda-l2:DIR | kernel:FILE | "
                   "gemmrl:FAMILY[+FAMILY] | ours | tuned | pack:DIR[@nearest=D]")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--db", default=DEFAULT_DB, show_default=True, help="SQLite store (created if missing)")
@click.option("--out", default="results", show_default=True, help="where results/<gpu>/ goes")
@click.option("--subject", default=None, help="implementation whose speedups the report shows")
@click.option("--qps", default=1000.0, show_default=True, help="server mode: mean arrivals per second")
@click.option("--host-ci", default=None, type=click.FloatRange(0.0005, 0.5),
              help="offline/server: sample until every median (server: the --server-stat) is known to "
                   "within this relative CI half-width (default 0.005: two timings of one implementation "
                   "then agree within 2%), at most --host-max-s per shape (protocol v3; server mode v5 "
                   "(paired) or v4 (mean))")
@click.option("--host-max-s", default=None, type=click.FloatRange(0.1, 600),
              help="the most seconds of sampling per shape and mode under the precision target "
                   "(default 5 offline, 12 in server mode)")
@click.option("--kernel-ci", default=None, type=click.FloatRange(0.0005, 0.5),
              help="kernel mode: sample until every --kernel-stat is known to within this relative CI "
                   "half-width (default 0.005), at most --kernel-max-s per shape (protocol v3; v2 on medians)")
@click.option("--kernel-max-s", default=None, type=click.FloatRange(0.1, 600),
              help="kernel mode: the most seconds of rounds per shape under the precision target (default 3)")
@click.option("--kernel-stat", default="paired", show_default=True, type=click.Choice(["paired", "median"]),
              help="kernel mode: the statistic the precision target is on and the reports compare: paired "
                   "(each pair's median within-round time ratio: the clock the round's replays share "
                   "divides out) or median")
@click.option("--quick", is_flag=True,
              help="no precision target: kernel mode 10 to 40 rounds and 0.5 s per shape (protocol v1), "
                   "offline/server 30 / 40 rounds and 0.5 s per shape (protocol v2): several times "
                   "cheaper, for sweeps; the noise is still measured and reported, not bounded")
@click.option("--server-gaps", default=None, type=click.Choice(["each", "round"]),
              help="server mode: one idle gap per round that every implementation waits (round, the "
                   "default: the same gaps for all, a fairer comparison, less noise), or a gap drawn "
                   "before each call (each: the protocol before 2026-11-22's fourth session)")
@click.option("--server-stat", default="paired", show_default=True, type=click.Choice(["paired", "mean"]),
              help="server mode: the statistic the precision target is on and the reports compare: "
                   "paired (each call's time over its round's median time, whose median is robust "
                   "to the machine state the round's calls share; every record keeps its mean too) "
                   "or mean")
@click.option("--budget-s", default=None, type=float, help="stop starting new shapes after this many seconds")
@click.option("--no-verify", is_flag=True, help="skip the correctness checks (not for real results)")
@click.option("--retime", is_flag=True, help="measure again what the store already has")
@click.option("--retime-after", "retime_after", default=None, type=click.IntRange(0), metavar="RUN",
              help="--retime, less what runs after store run RUN already measured (every implementation, "
                   "in that mode and protocol): a cut retime resumed by the same command in a later call")
@click.option("--no-report", is_flag=True, help="do not write CSVs, summary and plots at the end")
@click.option("--isolate/--no-isolate", default=True, show_default=True,
              help="run each shape in a worker process: a crashing or hanging kernel is quarantined, "
                   "the run goes on")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 64),
              help="measure on this many GPUs of this machine at once: one child bench per GPU on a share "
                   "of the shapes, all writing --db; the report once at the end")
def bench(shape_spec, mode_opts, impl_opts, dtype, acc, db, out, subject, qps, host_ci, host_max_s, kernel_ci,
          kernel_max_s, kernel_stat, quick,
          server_gaps, server_stat, budget_s, no_verify, retime, retime_after, no_report, isolate, gpus):
    """Verify and time implementations over a set of shapes; results go to the store."""
    problems = _problems(shape_spec, dtype, acc)
    modes = _modes(mode_opts)
    if qps <= 0:
        raise click.BadParameter("must be positive", param_hint="--qps")
    if quick and any(v is not None for v in (host_ci, host_max_s, kernel_ci, kernel_max_s)):
        raise click.BadParameter("has no precision target: give --quick or --host-ci/--host-max-s/"
                                 "--kernel-ci/--kernel-max-s, not both", param_hint="--quick")
    if server_gaps is not None and "server" not in modes:
        raise click.BadParameter("is a server-mode setting; --mode has no server", param_hint="--server-gaps")
    if retime_after is not None:
        _check_run_exists(db, retime_after, "--retime-after")
        retime = True
    from gemmrl.bench import runner

    runner.require_gpu()
    if gpus > 1:
        return _on_gpus("bench", problems, gpus, subject)
    import torch

    from gemmrl.bench import env, timing
    from gemmrl.store.db import Store

    env.use_harness_settings()
    store = Store(db)
    device = torch.cuda.get_device_name()
    impls = build_impls(impl_opts, store, device)
    prov = env.provenance(_cublas_version())
    cfg = runner.RunConfig(modes=modes, do_verify=not no_verify, retime=retime, retime_after=retime_after,
                           kernel=timing.KernelSettings(**kernel_precision(quick, kernel_ci, kernel_max_s,
                                                                           kernel_stat)),
                           offline=timing.HostSettings(mode="offline",
                                                       **host_precision("offline", quick, host_ci, host_max_s)),
                           server=timing.HostSettings(mode="server", min_rounds=40,
                                                      **host_precision("server", quick, host_ci, host_max_s),
                                                      qps=qps, gaps=server_gaps or "round", stat=server_stat),
                           deadline=time.monotonic() + budget_s if budget_s else None)
    settings = {"modes": modes, "impls": [i.name for i in impls], "shapes": shape_spec,
                **{m: timing.settings_dict(getattr(cfg, m)) for m in modes}, "verify": not no_verify}
    run_id = store.start_run(" ".join(["gemmrl"] + sys.argv[1:]), device, prov, settings)
    click.echo(f"run {run_id}: {len(problems)} shapes x {len(impls)} implementations x "
               f"{len(modes)} modes on {device} (driver {prov['driver']}, CUDA {prov['cuda']}, "
               f"torch {prov['torch']})", err=True)
    if store.latest_peaks(device) is None or retime:
        peaks = env.measure_peaks()
        store.record_peaks(run_id, device, peaks["matrix_tflops"], peaks["bandwidth_gbs"])
        click.echo(f"peaks: {peaks['matrix_tflops']:.0f} TFLOP/s, {peaks['bandwidth_gbs']:.0f} GB/s "
                   f"(copy {peaks['copy_gbs']:.0f}, read {peaks['read_gbs']:.0f})", err=True)
    from gemmrl.build.pool import default_jobs

    # compile, then time, a slice of the shapes at a time: a run cut early (a budget, a SIGTERM)
    # keeps the slices it timed, where building every shape's kernels first could spend all its
    # time compiling (the forty-fifth session: 119 kernels, 150 s, then the step's end: 0 sessions)
    per_slice = default_jobs()  # one wave of parallel nvcc processes
    plans = build_plans(impls, problems)  # once: each slice compiles its share of them
    slices = cut_slices(problems, unbuilt_counts(plans), per_slice)
    if len(slices) > 1:
        click.echo(f"compiling and timing in {len(slices)} slices of the {len(problems)} shapes "
                   f"(at most {per_slice} kernels to compile in each)", err=True)
    status = "partial"  # until the run comes to its end (an exception or SIGTERM leaves it so)
    try:
        def time_part(part):
            if isolate:
                def run_fn(progress, log):
                    return runner.run_isolated(part, impl_opts, store, cfg, device=device, run_id=run_id,
                                               db_path=str(db), progress=progress, log=log)
            else:
                def run_fn(progress, log):
                    return runner.run(part, impls, store, cfg, device=device, run_id=run_id,
                                      progress=progress, log=log)
            return _run_with_progress(run_fn, len(part))
        counts = {"sessions": 0, "skipped": 0, "rejected": 0, "quarantined": 0, "errors": 0,
                  **time_in_slices(impls, plans, slices, time_part, log=lambda m: click.echo(m, err=True),
                                   deadline=cfg.deadline)}
        status = "partial" if counts["stopped"] else "done"
        if counts["stopped"]:  # a SIGTERM can land after a worker stored a session, before it was counted
            # (H200, run 719: "measured 26", 27 sessions in the store)
            counts["sessions"] = max(counts["sessions"], store.run_session_count(run_id))
        click.echo(f"measured {counts['sessions']} (shape, mode) sessions, skipped "
                   f"{counts['skipped']} already in the store, rejected {counts['rejected']}, "
                   f"quarantined {counts.get('quarantined', 0)}", err=True)
    finally:
        store.finish_run(run_id, status)
    try:
        for line in run_noise_lines(store.run_measurements(run_id)):
            click.echo(line, err=True)
    except Exception as e:  # informational: never cost the run its report
        click.echo(f"(could not summarize this run's noise: {type(e).__name__}: {e})", err=True)
    if not no_report:
        paths = write_report(store, device, out, subject, dtype, acc)
        click.echo(f"wrote {len(paths)} files under {Path(paths[0]).parent if paths else out}", err=True)
    store.close()


def run_noise_lines(records: list[dict]) -> list[str]:
    """What a bench run says about its own noise at the end, per mode, from the report's own
    summary of the run's records: how many shapes' repeat timing agreed within 2% (by the ratio
    the reports compare) and the worst, and how many host sessions stopped at the time cap before
    their precision target."""
    from gemmrl.report.export import summarize

    s = summarize([r for r in records if r.get("status") == "ok"], None)
    precision = s.get("precision", {})
    lines = []
    for mode, impls in s["noise"].items():
        for impl, v in impls.items():
            if not v.get("count"):
                continue
            within = round(v["share_within_2pct"] * v["count"])
            line = (f"noise, {mode}: {impl} timed twice agreed within 2% on {within} of {v['count']} shapes "
                    f"(median {100 * v['median']:.2f}%, worst {100 * v['max']:.2f}% at {v['worst']})")
            if mode in precision:
                p = precision[mode]
                line += (f"; {p['target_not_reached']} of {p['shapes_with_target']} stopped at the time cap "
                         f"before their precision target")
            lines.append(line)
    return lines


def _gpu_model(gpus: int) -> str:
    """The one GPU model of this machine's first `gpus` GPUs; a usage error if it has fewer or
    they differ (timings are only compared within one model)."""
    import torch

    have = torch.cuda.device_count()
    if gpus > have:
        raise click.UsageError(f"--gpus {gpus}: this machine shows {have} GPU(s)")
    names = {torch.cuda.get_device_name(i) for i in range(gpus)}
    if len(names) > 1:
        raise click.UsageError(f"--gpus {gpus}: the GPUs are of different models ({', '.join(sorted(names))}); "
                               "timings are only compared within one model: set CUDA_VISIBLE_DEVICES to one model's")
    return names.pop()


def _on_gpus(verb: str, problems, gpus: int, subject: str | None, searched=None) -> None:
    """gemmrl tune|bench --gpus N: one child per GPU on a share of the shapes (by expected work;
    `searched(device)`: shapes that weigh almost nothing), every other option of this command
    passed on (distributed/local.py), then one report over the store they all wrote."""
    import tempfile

    from gemmrl.bench import env
    from gemmrl.distributed import local
    from gemmrl.store.db import Store

    ctx = click.get_current_context()
    params = ctx.params
    device = _gpu_model(gpus)
    done = searched(device) if searched is not None else set()
    shards = [s for s in local.split_shapes(problems, gpus, frozenset(done)) if s]
    ids = local.visible_gpus(len(shards))
    click.echo(f"{'tuning' if verb == 'tune' else 'measuring'} {len(problems)} shapes"
               + (f" ({len(done)} already searched)" if searched is not None else "")
               + f" on {len(shards)} GPUs ({device}; CUDA_VISIBLE_DEVICES {','.join(ids)}): "
               + ", ".join(f"{len(s)} shapes" for s in shards), err=True)
    with tempfile.TemporaryDirectory(prefix="gemmrl-shards-") as tmp:
        cmds = [local.child_command(verb, ctx.command, params,
                                    str(local.write_shard(s, Path(tmp) / f"shard{i}.txt")), len(shards))
                for i, s in enumerate(shards)]
        codes = local.run_children(cmds, ids, lambda m: click.echo(m, err=True))
    failed = [f"GPU {g} (exit {c})" for g, c in zip(ids, codes) if c != 0]
    if not params["no_report"] and not params.get("search_only") and Path(params["db"]).exists():
        store = Store(params["db"])
        try:
            paths = write_report(store, device, params["out"], subject, params["dtype"], params["acc"])
            click.echo(f"wrote {len(paths)} files under {Path(params['out']) / env.gpu_slug(device)}", err=True)
        except Exception as e:  # nothing measured (every child failed): the failure below says why
            if not failed:
                raise
            click.echo(f"no report: {type(e).__name__}: {e}", err=True)
        finally:
            store.close()
    if failed:
        raise click.ClickException(f"{verb} failed on " + ", ".join(failed) + "; what they stored stays: run "
                                   "again to resume")


def _run_with_progress(run_fn, total: int):
    """run_fn(progress, log) -> counts, with a live bar on a terminal and periodic lines in logs."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # logs: one line every few percent instead of a live bar
        step = max(1, total // 50)
        t0 = time.monotonic()

        def progress(done, problem):
            if done % step == 0 or done == total:
                el = time.monotonic() - t0
                eta = el / done * (total - done)
                console.print(f"[{done}/{total}] {problem.shape}  elapsed {el:.0f}s  eta {eta:.0f}s")
        return run_fn(progress, lambda m: console.print(m, markup=False))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("benchmark", total=total)

        def progress(done, problem):
            bar.update(task, completed=done, description=f"benchmark {problem.shape}")
        return run_fn(progress, lambda m: bar.console.print(m, markup=False))


def write_report(store, device, out, subject, dtype, acc, records=None):
    from gemmrl.bench.env import gpu_slug
    from gemmrl.report.export import write_results

    if records is None:  # each shape's ratios from one session: the latest that timed the subject
        records = store.report_measurements(subject or "torch.matmul", device=device, dtype=dtype, acc=acc)
    if not records:
        raise click.ClickException(f"the store holds no measurements for {device} ({dtype}, acc {acc})")
    runs = [r for r in store.runs() if r["device"] == device]
    # the top level describes the newest run whose measurements the report shows, not the device's
    # newest run of any kind (an fp16 settle set the fp32 summary's torch settings, 2026-11-28)
    used = {r.get("run_id") for r in records}
    mine = [r for r in runs if r["id"] in used] or runs
    prov = dict(mine[-1]["provenance"]) if mine else {}
    prov["runs"] = [{"id": r["id"], "command": r["command"], "status": r["status"],
                     "commit": r["provenance"].get("commit"), "date": r["provenance"].get("date")}
                    for r in runs]
    from gemmrl.search.run import TUNED

    if subject == TUNED:  # what the tuning cost, for "say how long it took", and who won where
        from gemmrl.report.export import family_breakdown

        prov["tuning"] = store.tuning_effort(device, dtype, acc, TUNED)
        prov["families"] = family_breakdown(records, TUNED, store.tuned_families(device, dtype, acc, TUNED))
        # runs whose kernel-mode ratios read apart from the same kernels' other sessions: a report row
        # from one of them carries the shift until its shape is timed again (gemmrl targets says so)
        from gemmrl.report.bias import ratios, scan, slow_rows

        rows = ratios(store.db, device, acc, dtype, "kernel")
        prov["run_bias"] = scan(rows)
        # and rows whose latest session sat beside slow library sessions (the baseline read slow)
        prov["slow_library_rows"] = slow_rows(store.db, rows, device)
    if subject == "cuda-l2":
        prov.update(cuda_l2_origin(store, device, dtype, acc))
    peaks = store.reference_peaks(device)
    subj = subject or "torch.matmul"
    return write_results(records, Path(out) / gpu_slug(device), subj, peaks, prov,
                         report_prefix(subj, device, dtype, acc))


def cuda_l2_origin(store, device: str, dtype: str, acc: str) -> dict:
    """Of the CUDA-L2 kernels that passed verification on this device (the latest verification
    per shape): how many were written for each GPU ('cuda_l2_written_for': {'a100': 25}; their
    fp16-accumulator kernels exist only for the A100, and a report of them on a Hopper GPU must
    say so), and the shapes whose call padded the inputs inside the timed call
    ('cuda_l2_padded', where the record says; their own harness pads outside the clock)."""
    from gemmrl.baselines.cuda_l2 import written_for

    latest = {}
    for v in store.verifications(device, impl="cuda-l2"):
        if v["dtype"] == dtype and v["acc"] == acc:
            latest[(v["M"], v["N"], v["K"])] = v  # in id order: the latest stays
    passed = {k: v for k, v in latest.items() if v["passed"]}
    return {"cuda_l2_written_for": dict(Counter(written_for(v["details"]) or "unknown" for v in passed.values())),
            "cuda_l2_padded": [f"{m}x{n}x{k}" for (m, n, k), v in sorted(passed.items())
                               if ((v["details"] or {}).get("impl") or {}).get("padded")]}


def report_prefix(subject: str, device: str, dtype: str, acc: str) -> str:
    """'<subject>_<gpu>_<precision>', the stem of a report's files."""
    from gemmrl.bench.env import gpu_slug
    from gemmrl.core.problem import Problem

    tag = Problem(64, 64, 64, dtype, acc).precision
    return f"{subject.replace('.', '_').replace(':', '_')}_{gpu_slug(device)}_{tag}"


def _open_for_reading(db, device, *, require_measured: bool):
    """The store, read-only, and the device to read: the one named (or the only one whose name
    holds --device, case aside: `--device H100`), or the only one measured."""
    from gemmrl.store.db import Store, device_by_part, unpack_if_missing

    unpack_if_missing(db)  # a store committed as DB.xz
    if not Path(db).exists():
        raise click.ClickException(f"no store at {db}")
    store = Store(db, readonly=True)
    devices = store.devices()
    if device is None:
        if len(devices) != 1:
            raise click.ClickException(f"the store holds {len(devices)} devices ({', '.join(devices)}): "
                                       "name one with --device")
        device = devices[0]
    else:
        try:
            device = device_by_part(device, devices)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if require_measured and device not in devices:
        raise click.ClickException(f"no measurements for {device!r}; the store has: {', '.join(devices)}")
    return store, device


@main.command()
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--out", default="results", show_default=True)
@click.option("--device", default=None, help="device name in the store, or a unique part of it (default: the only one)")
@click.option("--subject", default=None, help="implementation whose speedups are reported")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--versus", multiple=True, metavar="IMPL",
              help="also write the subject's speedup over IMPL per shape and mode (e.g. cuda-l2); repeatable")
@click.option("--since-run", "since_run", default=None, type=click.IntRange(1, None), metavar="N",
              help="only measurements of run N and later: a report of one session's work, without the "
                   "older sessions of shapes it did not time")
def report(db, out, device, subject, dtype, acc, versus, since_run):
    """Write CSVs (CUDA-L2's layout), the summary JSON and plots from the store (no GPU needed)."""
    store, device = _open_for_reading(db, device, require_measured=True)
    subj = subject or "torch.matmul"
    records = store.report_measurements(subj, device=device, dtype=dtype, acc=acc)
    if since_run is not None:
        # the subject's latest session per shape and mode is kept whole where it is recent enough;
        # an implementation it did not time joins only from a recent run too
        records = [r for r in records if r["run_id"] >= since_run]
        if not any(r["impl"] == subj for r in records):
            raise click.ClickException(f"--since-run {since_run}: no ok measurement of {subj!r} on {device} "
                                       f"({dtype}, acc {acc}) from run {since_run} on; nothing written")
    for other in versus:  # before anything is written: a bad --versus leaves the old files whole
        if not any(r["impl"] == other for r in records):
            raise click.ClickException(f"--versus {other}: the store has no ok measurement of {other!r} "
                                       f"on {device} ({dtype}, acc {acc}); nothing written")
    paths = write_report(store, device, out, subject, dtype, acc, records)
    if versus:
        from gemmrl.bench.env import gpu_slug
        from gemmrl.report.export import ReportError, write_versus

        prefix = report_prefix(subj, device, dtype, acc)
        l2 = cuda_l2_origin(store, device, dtype, acc) if "cuda-l2" in (subj, *versus) else None
        for other in versus:
            try:
                paths += write_versus(records, Path(out) / gpu_slug(device), subj, other, prefix, l2)
            except ReportError as e:
                raise click.ClickException(str(e)) from None
    for p in paths:
        click.echo(p)
    mixed = {}
    for r in records:
        if r["impl"] == subj and r.get("protocol"):
            mixed.setdefault(r["mode"], Counter())[r["protocol"]] += 1
    for mode, per in sorted(mixed.items()):
        if len(per) > 1:  # ratios under different yardsticks: say so beside the numbers
            click.echo(f"note: {mode} mode mixes measuring protocols ("
                       + ", ".join(f"{n} shape{'s' * (n != 1)} {proto}" for proto, n in per.most_common())
                       + "): the summary's 'protocols'; retime the older ones to compare like with like",
                       err=True)


@main.command()
@click.option("--results", "results_dir", default="results", show_default=True,
              help="where `gemmrl report` wrote results/<gpu>/")
@click.option("--device", required=True, help="the GPU's report folder or a name holding it: h100, H200, "
                                               "'NVIDIA H100 80GB HBM3'")
@click.option("--subject", default="gemmrl-tuned", show_default=True)
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]),
              help="the input type of the reports to judge (`gemmrl report --dtype`)")
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--product", multiple=True, metavar="JSON",
              help="scripts/product-report.py's JSONs over the grid, the newest for each mode used "
                   "(default: every product-vs-torch-grid-*.json in the report folder); repeatable")
@click.option("--json", "json_out", default=None, metavar="FILE", help="also write the result as JSON")
def targets(results_dir, device, subject, dtype, acc, product, json_out):
    """Check the speed targets of the kernel-families (#3) and whole-grid (#4) issues against the
    committed reports (no store, no GPU): one row per target, met or not, with the numbers."""
    from gemmrl.bench.env import gpu_slug
    from gemmrl.core.problem import Problem
    from gemmrl.report.export import write_json
    from gemmrl.report.targets import evaluate, markdown

    gpu = gpu_slug(device)
    try:
        precision = Problem(64, 64, 64, dtype, acc).precision
    except ProblemError as e:
        raise click.UsageError(str(e)) from None
    try:
        result = evaluate(results_dir, gpu, subject, precision, product or None)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(markdown(result), nl=False)
    if json_out:
        click.echo(write_json(json_out, result))


@main.command()
@click.option("--shapes", "shape_spec", default="subset", show_default=True,
              help="grid | subset | subset:N | preset:NAME | FILE | MxNxK[,MxNxK...]")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--candidates", default=32, show_default=True, type=click.IntRange(1, 10000),
              help="candidate kernels per shape, the earlier runs' included")
@click.option("--more", default=None, type=click.IntRange(1, 10000),
              help="instead of --candidates: this many candidates per shape beyond those the store holds "
                   "(a rerun searches as many more again, starting with the shapes no search reached in "
                   "the last 12 hours, then those searched longest ago, so that it goes on where a run cut "
                   "by its deadline stopped)")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1, 256))
@click.option("--budget-s", default=None, type=float, help="device seconds for the search (default: none)")
@click.option("--wall-s", default=None, type=float,
              help="stop starting new batches after this many seconds of wall time, the baselines' "
                   "measurement included (then the winners are timed and reported; a rerun resumes). The "
                   "baselines take half of it at most: shapes whose baselines are not measured by then are "
                   "left to a rerun, and the search takes the rest")
@click.option("--finish-s", default=None, type=click.FloatRange(min=1),
              help="instead of --wall-s: finish the whole run, the race and the final timing included, within "
                   "this many seconds of wall time (for a job with a hard limit): the search starts no batch "
                   "once what is left is what the final timing of the shapes it has reached needs (about 8 s "
                   "a shape with --race 1, more with a longer race, and 45 s for each CUTLASS kernel its races "
                   "would compile, side by side on the cores). The baselines take half of it at most")
@click.option("--no-report", is_flag=True, help="do not write CSVs, summary and plots at the end")
@click.option("--seed-from-lt", "seed_from_lt", is_flag=True,
              help="seed each shape's first batch with the CUTLASS kernels of cuBLASLt autotuned's own "
                   "choice there (its stored tile and cluster, in our orientation: search/lt_seed.py; with --acc "
                   "fp16 the fp16 autotuning's pick first, then the fp32 one's), beside any --transfer-from; "
                   "the baselines must have been measured on this GPU")
@click.option("--reuse-baselines", is_flag=True,
              help="time only the winners at the end and compare them with the baselines already in the "
                   "store (default: time the baselines again beside them, so each ratio is from one run)")
@click.option("--family", "family_opts", multiple=True, default=("cutlass_sm90", "raw"), show_default=True,
              help="kernel families to search (repeat for several)")
@click.option("--built-only", is_flag=True,
              help="propose CUTLASS (generic) kernels only where the build cache already holds them "
                   "(see gemmrl build); per-shape kernels are always built")
@click.option("--match", "match", default=None, metavar="REGEX",
              help="propose only kernels whose name matches this regular expression (re.search), e.g. "
                   "'splitk[0-9]+sr' for split-K with the separate reduction; the earlier trials still count")
@click.option("--layouts", default="NN,TN", show_default=True)
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--out", default="results", show_default=True)
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="evaluate candidates on a Ray cluster, one worker per GPU of the same model as "
                   "this one ('auto', or host:port); needs pip install 'gemmrl[distributed]'")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 64),
              help="tune on this many GPUs of this machine (same model), one process each on a share of "
                   "the shapes, all writing the one store; --budget-s is split among them, --wall-s is each's")
@click.option("--race", default=1, show_default=True, type=click.IntRange(1, 16),
              help="before the final timing, race each new winner against the search's next best "
                   "candidates (up to this many in all, within 10% of it) in the full kernel protocol and "
                   "keep the fastest: the search's quick timing misranks the largest shapes. The winner that "
                   "last passed the final verification always races too (so with 1, a new winner races only "
                   "the old one); with --built-only, CUTLASS contenders only if already built")
@click.option("--transfer-from", "transfer_from", multiple=True, metavar="GPU[:[IN/]ACC]",
              help="seed the search with what tuning found on another GPU model in the store, of the same "
                   "architecture ('NVIDIA H200' or 'h200', for an H100): per shape its winner and runners-up lead "
                   "the first batch (for untuned shapes, the nearest tuned ones'; on shapes searched already, the "
                   "first three not yet tried); `gemmrl build --tuned-in DB --device GPU --race K` compiles them "
                   "ahead. GPU:ACC ('h200:fp32', this GPU too) takes that GPU's tuning with the ACC accumulator, "
                   "each kernel rebuilt with this run's --acc; GPU:IN/ACC ('h200:fp16/fp32' for a --dtype bf16 "
                   "run) takes its tuning of IN inputs too, each kernel rebuilt with this run's --dtype: `gemmrl "
                   "build --tuned-in DB --transfer-from GPU:ACC --shapes S --acc A` compiles what it proposes "
                   "first. Repeatable: the sources' "
                   "suggestions interleaved by rank (each one's winner first)")
@click.option("--policy", "policy_name", default="model-free", show_default=True,
              type=click.Choice(["model-free", "random", "exhaustive"]),
              help="the search: the model-free policy that tunes; the pool in a seeded random order; or every "
                   "spec of the pool (--candidates 10000), the sweep a sample-efficiency study compares with "
                   "(scripts/sample-efficiency.py; use a store of the study's own, --db)")
@click.option("--seed", default=0, show_default=True, type=int, help="the policy's random seed")
@click.option("--search-only", is_flag=True,
              help="stop after the search: no race, no final verification and timing, no report (a study's "
                   "trials; the stored choices await their final verification, which a later run without "
                   "this flag does)")
@click.option("--build-ahead", "build_ahead_n", default=None, type=click.IntRange(0, 4096), metavar="N",
              help="when a shape's batch has fewer than N kernels (--more 2), propose the next shapes' first "
                   "batches too and compile them all side by side, up to N kernels, before timing the first "
                   "(default: this machine's cores; 0: each batch compiles its own; not with --ray)")
def tune(shape_spec, dtype, acc, candidates, more, batch, budget_s, wall_s, finish_s, built_only, family_opts, match,
         layouts, db, out, ray_address, gpus, no_report, seed_from_lt, reuse_baselines, race, transfer_from, policy_name,
         seed, search_only, build_ahead_n):
    """Search kernels per shape with speed over the best baseline as the reward; keep the winners.

    Baselines are measured first (kernel mode) where the store lacks them; then the model-free
    policy proposes candidates, each batch built, verified and timed in a worker process; every
    trial is stored and the run resumes from them; finally the winners ('gemmrl-tuned') are
    verified in full and timed beside the baselines (measured again, unless --reuse-baselines),
    and the report is written."""
    problems = _problems(shape_spec, dtype, acc)
    lays = _layouts(layouts)
    _check_match(match)
    if wall_s and finish_s:
        raise click.UsageError("--wall-s bounds the search, --finish-s the whole run: give one")
    if finish_s and search_only:
        raise click.UsageError("--finish-s keeps time for the final timing, which --search-only skips: use --wall-s")
    if transfer_from and policy_name != "model-free":
        raise click.UsageError(f"--transfer-from seeds the model-free policy; the {policy_name} policy takes none")
    if seed_from_lt and policy_name != "model-free":
        raise click.UsageError(f"--seed-from-lt seeds the model-free policy; the {policy_name} policy takes none")
    if build_ahead_n and ray_address is not None:
        raise click.UsageError("--build-ahead compiles on this machine, --ray evaluates (and builds) on the "
                               "cluster's: give one")
    no_report = no_report or search_only
    from gemmrl.space import registry

    try:
        fams = tuple(registry.get(f).name for f in family_opts)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--family") from None
    from gemmrl.build import toolchain
    from gemmrl.search.policy import DEFAULT_FAMILIES

    # before anything runs: without nvcc or the CUTLASS headers every candidate of a family would
    # fail to build and be stored as rejected, never to be proposed again (2026-12-01)
    toolchain.require(fams or DEFAULT_FAMILIES, "tune")
    if ray_address is not None:
        from gemmrl.distributed import ray_backend

        if not ray_backend.available():
            raise click.ClickException(f"--ray needs Ray, which is not installed: {ray_backend.INSTALL_HINT}")
    from gemmrl.bench import runner

    runner.require_gpu()
    import torch

    if gpus > 1:
        if ray_address is not None:
            raise click.UsageError("--gpus and --ray are two ways to use several GPUs: choose one")
        from gemmrl.search.run import TUNED
        from gemmrl.store.db import Store

        def searched(device: str) -> set:  # shapes whose search is over weigh nothing in the split
            if not Path(db).exists():
                return set()
            store = Store(db)
            tried = store.trial_counts(device)
            done = {p for p in problems if more is None and tried.get(p.key(), 0) >= candidates
                    and store.get_tuning(device, p, TUNED) is not None}
            store.close()
            return done
        return _on_gpus("tune", problems, gpus, TUNED, searched)
    from gemmrl.bench import env, timing
    from gemmrl.search.run import TUNED, isolated_evaluator, promote_runner_up, rejected_winners, run_tune
    from gemmrl.search.tune import best_baseline_from_store, write_curves
    from gemmrl.store.db import Store

    store = Store(db)
    device = torch.cuda.get_device_name()
    env.use_harness_settings()  # as the workers time, so that the provenance says so
    prov = env.provenance(_cublas_version())  # packs read it: their lt_algos need it
    sources = []
    for text in transfer_from:
        gpu, source_acc, source_dtype = split_transfer_source(text)
        sources.append((_check_transfer_source(store, gpu, device, prov.get("capability"),
                                               cross_acc=source_acc not in (None, acc)
                                               or source_dtype not in (None, dtype)), source_acc, source_dtype))
    run_id = store.start_run(" ".join(["gemmrl"] + sys.argv[1:]), device, prov,
                             {"candidates": candidates, "more": more, "batch": batch, "budget_s": budget_s,
                              "layouts": lays, "policy": policy_name, "seed": seed, "search_only": search_only})
    kernel_only = runner.RunConfig(modes=("kernel",))  # the baselines the search's reward is taken over
    # the final timing (the race and the winners beside the baselines): bench's kernel protocol (v3,
    # paired ratios), so a tune's numbers and a bench retime's are of one yardstick (before the
    # twenty-seventh session it was v1, and the reports mixed the two)
    judge = runner.RunConfig(modes=("kernel",), retime=True,
                             kernel=timing.KernelSettings(**kernel_precision(False, None, None)))
    if built_only:  # the race times each incumbent, built or not: say so before an hour's call spends it
        from gemmrl.search.race import unbuilt_incumbents

        missing = unbuilt_incumbents(store, device, problems)
        if missing:
            click.echo(f"warning: the incumbent winners of {len(missing)} shapes are not in the build cache; the "
                       f"final race compiles each (about 45 s apiece), e.g. {missing[0][1].name} "
                       f"({missing[0][0].shape}); `gemmrl build --tuned-in {db} --device '{device}' --race {race} "
                       f"--shapes {shape_spec}` compiles them ahead", err=True)

    def measure(specs, what, cfg=kernel_only, probs=None):
        probs = problems if probs is None else probs
        click.echo(what, err=True)
        return compile_then_time(specs, probs, store, device, lambda part: _run_with_progress(
            lambda progress, log: runner.run_isolated(part, specs, store, cfg, device=device, run_id=run_id,
                                                      db_path=str(db), progress=progress, log=log), len(part)),
                                 log=lambda m: click.echo(m, err=True))

    status, short = "partial", False
    t_start = time.monotonic()
    try:
        # --wall-s: the baselines get half of it at most, so that a call's search is not spent on
        # them (H100, 2026-11-27: 200 shapes' baselines took a whole 494 s call and nothing was
        # searched); the shapes whose baselines were not measured by then wait for a rerun
        wall = wall_s or finish_s
        base = measure(("baselines",), "baselines (the reward's yardstick), kernel mode",
                       kernel_only if not wall else dataclasses.replace(kernel_only, deadline=t_start + wall / 2))
        if base.get("deadline_after") is not None:
            n = base["deadline_after"]
            click.echo(f"{'--wall-s' if wall_s else '--finish-s'}: baselines measured for {n} of {len(problems)} "
                       f"shapes in half the wall time; "
                       f"the search takes those, a rerun the other {len(problems) - n}", err=True)
            problems, short = problems[:n], True
        # a SIGTERM there (a device call's timeout) stops the run: the runner caught it and left
        # SIGTERM ignored for its own clean exit, so a search started now could not be stopped
        if not problems:
            click.echo("no shape has its baselines: no search and no final timing", err=True)
        elif base.get("stopped") and not short:
            click.echo("stopped while measuring the baselines: no search and no final timing; "
                       "a rerun resumes from what the store holds", err=True)
        else:
            baseline_fn = best_baseline_from_store(store, device, "kernel")
            # after the baselines: the autotuned one stored its choices
            lt_prior = _lt_prior_for(store, device, problems, lays) if seed_from_lt else None
            if ray_address is not None:
                import ray

                ray.init(address=ray_address)
                evaluate, close = ray_backend.ray_evaluator(ray_address, store, device, str(db), baseline_fn,
                                                            log=lambda m: click.echo(m, err=True))
            else:
                evaluate, close = isolated_evaluator(store, device, str(db), baseline_fn,
                                                     log=lambda m: click.echo(m, err=True))
            best: dict = {}
            reserve = _final_reserve(store, device, problems, race, (kernel_only.protocol("kernel"),
                                                                     judge.protocol("kernel")),
                                     built_only, baseline_fn) if finish_s else None
            if reserve is not None and time.monotonic() + reserve(frozenset()) >= t_start + finish_s:
                click.echo(f"warning: --finish-s {finish_s:g}: the winners waiting for their final timing alone "
                           f"need about {reserve(frozenset()):.0f} s, more than is left; no search starts",
                           err=True)

            from gemmrl.build.pool import default_jobs
            from gemmrl.search.run import ahead_builder

            ahead_n = 0 if ray_address is not None else (default_jobs() if build_ahead_n is None else build_ahead_n)
            ahead_fn = ahead_builder(ahead_n, lambda m: click.echo(m, err=True)) if ahead_n else None

            def on_trial(t):
                if t.reward > best.get(t.problem, 0.0):
                    best[t.problem] = t.reward
                    click.echo(f"{t.problem.shape:>20}  best {t.reward:6.3f}x  {t.candidate.name}", err=True)
            try:
                t_search = time.monotonic()
                res = run_tune(problems, store, device, evaluate, candidates=candidates, batch=batch,
                               budget_s=budget_s or float("inf"), layouts=lays, run_id=run_id, on_trial=on_trial,
                               deadline=t_start + wall if wall else None, reserve=reserve,
                               generic_built_only=built_only, families=fams, match=match, more=more,
                               transfer_from=sources or None, policy_name=policy_name, seed=seed,
                               lt_prior=lt_prior, ahead=ahead_fn, ahead_kernels=ahead_n)
                search_wall = time.monotonic() - t_search
            finally:
                close()
            won = sum(1 for t in res.best.values() if t.reward > 1.0)
            # res.best holds the earlier runs' trials too: say how many shapes this run reached, so a
            # --wall-s spent before the search (the baselines' measurement counts) reads as such
            searched = len({t.problem for t in res.trials})
            click.echo(f"tuned {len(res.best)} shapes with {len(res.trials)} new candidates in {search_wall:.1f} s "
                       f"of wall time ({res.device_s:.0f} device s); faster than the best baseline on {won}"
                       + (f"; stopped: {res.stopped}" if res.stopped else ""), err=True)
            if res.failed:
                first = next(iter(res.failed.items()))
                click.echo(f"the policy failed on {len(res.failed)} shape(s), left unsearched (their earlier "
                           f"winners stand); first: {first[0].shape}: {first[1]}", err=True)
            if searched < len(problems):
                why = ""
                if res.stopped == "wall-clock deadline" and finish_s:
                    kept = reserve(frozenset(t.problem for t in res.trials))
                    why = (f" (--finish-s {finish_s:g}: it stopped with about {kept:.0f} s left to time the winners "
                           "of the shapes it reached)")
                elif res.stopped == "wall-clock deadline":
                    why = f" (the wall-clock deadline came {wall_s:g} s after the start, the baselines' measurement included)"
                again = (f"; a rerun with --more in the next 12 hours starts with the {len(problems) - searched} "
                         "it did not reach" if more is not None else "")
                click.echo(f"this run searched {searched} of its {len(problems)} shapes{why}{again}", err=True)
            if not no_report:
                write_curves({policy_name: res.per_shape_curve()}, Path(out) / env.gpu_slug(device) / "tune_curve")
            final = [] if search_only else shapes_to_time(problems, res.trials, store, device,
                                                          (kernel_only.protocol("kernel"), judge.protocol("kernel")))
            # the winner as stored, or chosen again by a race of the search's best (search/race.py)
            # with --race 1 too: a new winner must beat the one it replaces in one session (the
            # search's trial times and those of an earlier run do not compare); no incumbent, no race
            winner = f"race:{race}" + (":built" if built_only else "")
            raced = (f" (raced against up to {race - 1} more" if race > 1 else " (raced") + " and the incumbent)"
            counts: dict = {}
            t_final = time.monotonic()
            if search_only:
                click.echo("search only: no race and no final timing (a run without --search-only does them)",
                           err=True)
            elif not final:
                click.echo("no new winners to time", err=True)
            elif reuse_baselines:
                counts = measure(("baselines", winner), f"the winners of {len(final)} shapes{raced}, verified in "
                                 "full and timed (baselines from the store)", probs=final)
            else:  # the ratios the report shows come from one timing session per shape
                counts = measure(("baselines", winner), f"the winners of {len(final)} shapes{raced}, verified in "
                                 "full and timed beside the baselines, all measured again in one session per shape",
                                 judge, probs=final)
            cut = bool(counts.get("stopped"))  # SIGTERM or Ctrl-C during the final timing
            if final and not search_only:
                # what --finish-s's reserve is measured against (search.tune.final_reserve_s)
                kept = (f" (--finish-s kept {reserve(frozenset(t.problem for t in res.trials)):.0f} s for it)"
                        if reserve is not None else "")
                click.echo(f"the final timing of {len(final)} shapes took {time.monotonic() - t_final:.0f} s{kept}",
                           err=True)
            if cut:
                click.echo("the final timing was stopped; a rerun times the winners left", err=True)
            # a winner the full verification rejects gives way to the shape's next-best candidate
            for attempt in range(0 if cut else RUNNER_UP_ROUNDS):
                failed = rejected_winners(store, device, final, run_id)
                if not failed:
                    break
                promoted = []
                for p, reason in failed.items():
                    t = promote_runner_up(store, device, p, reason, run_id)
                    click.echo(f"{p.shape}: the winner failed the final verification; "
                               + (f"next: {t.candidate.name}" if t else "no other candidate passed, the libraries serve it"),
                               err=True)
                    if t is not None:
                        promoted.append(p)
                if not promoted:
                    break
                measure(("baselines", "tuned") if not reuse_baselines else ("tuned",),
                        f"the runners-up of {len(promoted)} shapes, verified in full and timed",
                        judge if not reuse_baselines else runner.RunConfig(modes=("kernel",), retime=True),
                        probs=promoted)
                final = promoted
            status = "partial" if cut or short else "done"
    finally:
        store.finish_run(run_id, status)
    if not no_report:
        paths = write_report(store, device, out, TUNED, dtype, acc)
        click.echo(f"wrote {len(paths)} files under {Path(out) / env.gpu_slug(device)}", err=True)
    store.close()


RUNNER_UP_ROUNDS = 3  # how many times a shape's rejected winner gives way to the next (tune)


def _lt_tables() -> tuple[dict, dict, str]:
    """cuBLASLt's tile and cluster enums (baselines.cublas.lt_enum_tables), from cublasLt.h where
    the cuBLAS build finds it or under this checkout's .ext/*/nvidia/cu13 (.ci/run's headers)."""
    from gemmrl.baselines.cublas import lt_enum_tables

    return lt_enum_tables(extra_roots=tuple(sorted(Path.cwd().glob(".ext/*/nvidia/cu13"))))


def _known_device(name: str, devices, missing: str) -> str:
    """The one of `devices` that `name` names (device_by_part), else a ClickException: `missing`,
    and the devices there are."""
    from gemmrl.store.db import device_by_part

    try:
        got = device_by_part(name, devices, "GPUs")
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if got not in devices:
        raise click.ClickException(missing + (f"; it has {', '.join(map(repr, sorted(devices)))}" if devices else ""))
    return got


def _lt_prior_for(store, device: str, problems, layouts) -> dict:
    """tune --seed-from-lt: the CUTLASS kernels of cuBLASLt autotuned's stored choices on these
    shapes (search.lt_seed.lt_prior), its enums read from cublasLt.h where one is found (else
    CUDA 11's, which know no tile above 35); says how many and from what."""
    from gemmrl.search.lt_seed import lt_prior

    tiles, clusters, source = _lt_tables()
    prior = lt_prior(store, device, problems, tiles, clusters, layouts)
    n = sum(len(v) for v in prior.values())
    click.echo(f"--seed-from-lt: {n} kernels after cuBLASLt autotuned's choices on {len(prior)} of "
               f"{len(problems)} shapes ({source})", err=True)
    return prior


def split_transfer_source(text: str) -> tuple[str, str | None, str | None]:
    """tune/build --transfer-from GPU[:ACC] or GPU:IN/ACC: the GPU's name, the accumulator and the
    input type named after its last colon ('h200:fp32' -> ('h200', 'fp32', None): the run's own
    input type; 'h200:fp16/fp32' -> ('h200', 'fp32', 'fp16'): the tuning of fp16 inputs with fp32
    accumulation, e.g. for a bf16 run; 'NVIDIA H200' -> ('NVIDIA H200', None, None))."""
    gpu, sep, tail = text.rpartition(":")
    word = tail.strip().lower()
    dtype, slash, acc = word.partition("/")
    if not slash:
        dtype, acc = None, word
    if sep and acc in ("fp32", "fp16") and dtype in (None, "fp16", "bf16"):
        if not gpu.strip():
            raise click.BadParameter(f"{text!r}: name the GPU before the accumulator (h200:fp32)",
                                     param_hint="--transfer-from")
        return gpu.strip(), acc, dtype
    if sep and slash:
        raise click.BadParameter(f"{text!r}: after the GPU, IN/ACC names an input type (fp16 or bf16) and an "
                                 "accumulator (fp32 or fp16), e.g. h200:fp16/fp32", param_hint="--transfer-from")
    return text, None, None


def _check_transfer_source(store, source: str, device: str, capability: str | None,
                           cross_acc: bool = False) -> str:
    """tune --transfer-from: the source must be another GPU model the store has tuning of (its
    name as torch gives it, or its short name: 'h200'), and of this GPU's architecture where its
    runs recorded one (kernels for another one would not load). With `cross_acc` (the source's
    tuning with the other accumulator) it may be this GPU. Returns its name in the store."""
    from gemmrl.bench.env import gpu_slug

    tuned = {c[0] for c in store.tuned_choices("gemmrl-tuned")}
    if source not in tuned:
        named = [d for d in tuned if gpu_slug(d) == source.lower()]
        source = named[0] if len(named) == 1 else source
    if source == device and not cross_acc:
        raise click.BadParameter(f"{source!r} is this GPU: its own trials already seed the search",
                                 param_hint="--transfer-from")
    if source not in tuned:
        raise click.BadParameter(f"the store {store.path} holds no tuning on {source!r}"
                                 + (f"; it has tuning on {', '.join(map(repr, sorted(tuned)))}" if tuned else ""),
                                 param_hint="--transfer-from")
    caps = {r["provenance"].get("capability") for r in store.runs() if r["device"] == source} - {None}
    if capability is not None and caps and capability not in caps:
        raise click.BadParameter(f"{source!r} is compute capability {', '.join(sorted(caps))}, this GPU "
                                 f"{capability}: its kernels are not this architecture's", param_hint="--transfer-from")
    return source


def shapes_to_time(problems, trials, store, device: str, protocol) -> list:
    """The shapes whose winners a tune run times at its end: those it tried candidates on, those
    with a stored winner never timed in kernel mode under `protocol` (a protocol string, or several:
    timed under any of them counts), and those whose stored winner is not the kernel
    the newest verification passed (a run cut between its search and the end of its final
    timing, which a rerun finishes; or a winner the newest check failed). Not the rest: a run over the grid that reached 60 shapes
    does not time the other 940 again."""
    from gemmrl.runtime.pack import verified_choice, verified_differs
    from gemmrl.search.run import TUNED

    touched = {t.problem for t in trials}
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    out = []
    for p in problems:
        row = store.get_tuning(device, p, TUNED)
        if p in touched:
            out.append(p)
        elif row is not None:
            ver = store.verification(device, p, TUNED)
            try:
                choice = json.loads(bytes(row["choice"]).decode())
            except ValueError:
                choice = {}
            if all(TUNED not in store.measured_impls(device, p, "kernel", pr) for pr in protocols) or (ver is not None and (
                    not ver["passed"] or verified_differs(choice, verified_choice(ver)))):
                out.append(p)
    return out


def _final_reserve(store, device: str, problems, race: int, protocols, built_only: bool = False,
                   baseline_us=None):
    """tune --finish-s: reached -> seconds the final timing will take (search.tune.final_reserve_s),
    over the shapes the search reached and those the final pass times anyway (shapes_to_time of
    a run with no trials: a stored winner not yet timed or not the verified one), counting the
    CUTLASS kernels their races would compile (race.unbuilt_contenders; each once) and each
    shape's best baseline kernel time (`baseline_us(problem)`, the search's yardstick; else read from
    the store): a millisecond kernel's rounds are long."""
    import os

    from gemmrl.search.race import unbuilt_contenders
    from gemmrl.search.tune import best_baseline_from_store, final_reserve_s

    always = frozenset(shapes_to_time(problems, [], store, device, protocols))
    unbuilt = unbuilt_contenders(store, device, problems, race, built_only)
    cores = os.cpu_count() or 1
    baseline_us = baseline_us or best_baseline_from_store(store, device, "kernel")
    kernel_us = {}
    for p in problems:
        try:
            kernel_us[p] = baseline_us(p)
        except KeyError:  # no baseline yet: the search does not reach it either
            pass

    def reserve(reached) -> float:
        shapes = always | frozenset(reached)
        builds = frozenset().union(*(unbuilt.get(p, frozenset()) for p in shapes))
        return final_reserve_s(len(shapes), race, len(builds), cores, [kernel_us[p] for p in shapes if p in kernel_us])
    return reserve


@main.command(name="llm")
@click.option("--shapes", "shape_spec", required=True, help="MxNxK[,...] | subset:N | preset:NAME | FILE")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--layout", default="NN", show_default=True, type=click.Choice(["NN", "TN"]))
@click.option("--turns", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--samples", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--token-budget", default=None, type=int, help="stop once the model has used this many tokens")
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--export", "export_path", default=None, help="write every trajectory as JSONL here")
def llm_cmd(shape_spec, dtype, acc, layout, turns, samples, token_budget, db, export_path):
    """Let a language model write and rewrite kernels from measured feedback.

    The endpoint is any OpenAI-compatible server: GEMMRL_LLM_BASE_URL, GEMMRL_LLM_MODEL and
    GEMMRL_LLM_API_KEY (never written to the store or logs). Every sample is static-checked,
    built in a sandbox, verified and timed in a worker process without credentials, rewarded
    against the best baseline, and stored as a trajectory."""
    problems = _problems(shape_spec, dtype, acc)
    from gemmrl.llm.client import LLMClient, LLMError

    try:
        client = LLMClient.from_env(token_budget=token_budget)
    except LLMError as e:
        raise click.ClickException(str(e)) from None
    from gemmrl.bench import runner

    runner.require_gpu()
    import torch

    from gemmrl.bench import env
    from gemmrl.llm.evaluate import gpu_source_evaluator
    from gemmrl.llm.loop import export_trajectories, refine
    from gemmrl.search.tune import best_baseline_from_store
    from gemmrl.store.db import Store

    store = Store(db)
    device = torch.cuda.get_device_name()
    env.use_harness_settings()
    run_id = store.start_run(" ".join(["gemmrl"] + sys.argv[1:]), device, env.provenance(_cublas_version()),
                             {"turns": turns, "samples": samples, "layout": layout, "model": client.model})
    click.echo("baselines (the reward's yardstick), kernel mode", err=True)
    runner.run_isolated(problems, ("baselines",), store, runner.RunConfig(modes=("kernel",)), device=device,
                        run_id=run_id, db_path=str(db), log=lambda m: click.echo(m, err=True))
    baseline_fn = best_baseline_from_store(store, device, "kernel")
    evaluate_source, close = gpu_source_evaluator(baseline_fn)
    status = "partial"
    try:
        for p in problems:
            res = refine(p, client, evaluate_source, turns=turns, samples=samples, store=store, device=device,
                         run_id=run_id, layout=layout,
                         on_outcome=lambda o, p=p: click.echo(
                             f"{p.shape} turn {o.turn} sample {o.sample}: {o.status}"
                             + (f" {o.time_us:.2f} us, reward {o.reward:.3f}" if o.status == "ok" else
                                f" ({o.reason[:120]})"), err=True))
            best = f"{res.best.reward:.3f}x" if res.best else "none"
            click.echo(f"{p.shape}: best {best} after {res.turns_done} turns ({res.stopped})", err=True)
            if res.stopped == "budget":
                break
        status = "done"
    finally:
        close()
        store.finish_run(run_id, status)
    if export_path:
        n = export_trajectories(store, export_path, device)
        click.echo(f"wrote {n} trajectories to {export_path}", err=True)
    store.close()


@main.command()
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--run", "run_ids", multiple=True, required=True, type=click.IntRange(1, None),
              help="a store run (repeatable): its sessions' repeat timings are compared")
@click.option("--json", "json_path", default=None, help="also write the table, with each run's provenance, here")
def noise(db, run_ids, json_path):
    """How well each implementation timed twice in one session (torch.matmul and its @repeat)
    agreed with itself, per run and mode; the judge's goal is within 2%. No GPU needed."""
    from gemmrl.report.noise import repeat_agreement
    from gemmrl.store.db import Store, unpack_if_missing

    unpack_if_missing(db)
    if not Path(db).exists():
        raise click.ClickException(f"no store at {db}")
    store = Store(db, readonly=True)
    runs = {r["id"]: r for r in store.runs()}
    missing = [r for r in run_ids if r not in runs]
    if missing:
        raise click.ClickException(f"no run {', '.join(map(str, missing))} in {db} (it has runs 1-{max(runs, default=0)})")
    doc = {"runs": []}
    click.echo("run  mode     impl           stat    shapes  within 2%  median    p90     max  worst            "
               "target met")
    for rid in run_ids:
        table = repeat_agreement(store.run_measurements(rid))
        run = runs[rid]
        doc["runs"].append({"run": rid, "command": run["command"], "device": run["device"],
                            "provenance": run["provenance"], "agreement": table})
        if not table:
            click.echo(f"{rid:<4d} (no implementation timed twice in this run)")
        for mode, impls in table.items():
            for impl, e in impls.items():
                met = f"{e['target_reached']}/{e['with_target']}" if e["with_target"] else "-"
                for stat, v in e["stats"].items():
                    click.echo(f"{rid:<4d} {mode:8s} {impl:14s} {stat:7s} {v['shapes']:6d}  {v['within']:4d}/{v['shapes']:<4d}"
                               f" {100 * v['median']:6.2f}% {100 * v['p90']:6.2f}% {100 * v['max']:6.2f}%  "
                               f"{v['worst']:16s} {met}")
    store.close()
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1))
        click.echo(f"wrote {json_path}", err=True)


@main.command()
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--device", default=None, help="device name in the store, or a unique part of it (default: the only one)")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--min-speedup", default=1.0, show_default=True, type=float,
              help="export a winner only if it beat the best baseline by this factor in kernel mode")
@click.option("--out", "out_dir", required=True, help="the pack directory (replaced if it exists)")
@click.option("--against", default=None, metavar="DIR",
              help="the pack to compare the export with (default: the one at --out, which it replaces)")
@click.option("--changed-shapes", "changed_file", default=None, metavar="FILE",
              help="write the shapes whose entries changed against that pack, one a line (a shape file: "
                   "`bench --shapes FILE --impl pack:OUT` times them through gemmrl.matmul)")
@click.option("--again-shapes", "again_file", default=None, metavar="FILE",
              help="write the shapes whose winner the export left out because its one kernel session's "
                   "baselines ran slow, one a line (`bench --shapes FILE --mode kernel --impl baselines "
                   "--impl tuned --retime` gives each the second session the next export decides on)")
def pack(db, device, dtype, acc, min_speedup, out_dir, against, changed_file, again_file):
    """Export the verified winners for one GPU as a pack (manifest + kernel sources); load it
    anywhere with gemmrl.use_pack(DIR). No GPU needed."""
    from gemmrl.runtime.pack import MANIFEST, PackError, changed_shapes, export_pack, pack_changes, time_again_shapes

    store, device = _open_for_reading(db, device, require_measured=False)
    previous = None
    base = Path(against or out_dir) / MANIFEST
    if against and not base.is_file():
        raise click.ClickException(f"--against {against}: not a pack (no {MANIFEST})")
    try:  # the pack this export replaces, to say what changed
        previous = json.loads(base.read_text())
    except (OSError, ValueError):
        pass
    try:
        path = export_pack(store, device, out_dir, dtype, acc, min_speedup=min_speedup)
    except PackError as e:
        raise click.ClickException(str(e)) from None
    manifest = json.loads((path / MANIFEST).read_text())
    previous = previous if isinstance(previous, dict) else None
    for line in pack_changes(manifest, previous):
        click.echo(line, err=True)
    if changed_file:
        shapes = changed_shapes(manifest, previous)
        against_what = base.parent if previous else "no pack"
        shapes_mod.write_shape_file(changed_file, shapes, f"{device}: the {len(shapes)} shapes whose {dtype}/{acc} "
                                    f"pack entries (kernels or cuBLASLt algorithms) changed against {against_what}")
        click.echo(f"{len(shapes)} changed shapes in {changed_file}", err=True)
    if again_file:
        shapes = time_again_shapes(manifest)
        shapes_mod.write_shape_file(again_file, shapes, f"{device}: the {len(shapes)} shapes whose {dtype}/{acc} "
                                    f"winner {path} left out for want of a second kernel session (its one "
                                    "session's baselines ran slow)")
        click.echo(f"{len(shapes)} shapes to time again in {again_file}", err=True)
    click.echo(str(path))


@main.command(name="store")
@click.option("--db", default=DEFAULT_DB, show_default=True)
@click.option("--compress", is_flag=True,
              help="write DB.xz beside the store (what git keeps: about a tenth of the size); any command "
                   "that finds DB missing and DB.xz present unpacks it first")
@click.option("--small", is_flag=True,
              help="with --compress: a VACUUMed copy at xz's strongest setting, about 10%% smaller and several "
                   "times slower (the committed store, which every device call carries)")
@click.option("--merge", "merge_from", default=None, metavar="OTHER",
              help="first add another store's runs that this one lacks (a second machine's, or a copy a "
                   "device call sent back), with their measurements, trials and winners; OTHER.xz is read too")
@click.option("--since-run", "since_run", default=None, type=click.IntRange(0, None), metavar="N",
              help="with --merge: only OTHER's runs after run N (and the winners and quarantines written since): "
                   "merged into a new DB, the work of one device call, small enough to send back")
@click.option("--release-quarantine", "release", default=None, metavar="NAME",
              help="remove the quarantine entries of this implementation or kernel (every device and precision, "
                   "or --shapes'), each printed with the reason it was quarantined: for a call that changed "
                   "since it crashed (CUDA-L2's unpadded calls before their tiles were read)")
@click.option("--shapes", "release_shapes", default=None, help="with --release-quarantine: only these shapes")
def store_cmd(db, compress, small, merge_from, since_run, release, release_shapes):
    """What the store holds (runs, measurements, trials, tuned shapes per device); --compress packs it."""
    from gemmrl.store.db import Store, StoreError, decompress, pack, unpack_if_missing

    if small and not compress:
        raise click.UsageError("--small goes with --compress")
    if since_run is not None and merge_from is None:
        raise click.UsageError("--since-run goes with --merge")
    if release_shapes is not None and release is None:
        raise click.UsageError("--shapes goes with --release-quarantine")
    unpack_if_missing(db)
    if release is not None:
        if not Path(db).exists():
            raise click.ClickException(f"no store at {db}")
        shapes = None if release_shapes is None else [(p.M, p.N, p.K) for p in _problems(release_shapes, "fp16", "fp32")]
        st = Store(db)
        gone = st.release_quarantine(release, shapes)
        st.close()
        for r in gone:
            click.echo(f"released {r['device']} {r['M']}x{r['N']}x{r['K']} ({r['dtype']}, {r['acc']}): {r['reason']}")
        if not gone:
            raise click.ClickException(f"{db} has no quarantine entry for {release!r}"
                                       + (" on those shapes" if shapes is not None else ""))
        click.echo(f"released {len(gone)} quarantine entr{'y' if len(gone) == 1 else 'ies'} of {release}")
    if merge_from is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(merge_from)
            if not src.exists():  # before the target is opened: that would create it, empty
                raise click.ClickException(f"no store at {merge_from}")
            if src.suffix == ".xz":  # a store as git keeps it, or as a device call returns it
                src = decompress(src, Path(tmp) / "other.sqlite")
            try:
                target = Store(db)
                added = target.merge(src, since_run=since_run)
                target.close()
            except StoreError as e:
                raise click.ClickException(str(e)) from None
        click.echo(f"merged {merge_from}: " + ", ".join(f"{n} {t}" for t, n in added.items()))
    if not Path(db).exists():
        raise click.ClickException(f"no store at {db}")
    store = Store(db, readonly=True)
    q = store.db.execute
    runs = q("SELECT COUNT(*) FROM runs").fetchone()[0]
    click.echo(f"{db}: {Path(db).stat().st_size / 1e6:.1f} MB, {runs} runs")
    # problems are (shape, input type, accumulator): a bf16 shape is not counted with the fp16 ones
    for dev, n_meas, n_shapes in q("SELECT device, COUNT(*), COUNT(DISTINCT M||'x'||N||'x'||K||dtype||acc) "
                                   "FROM measurements GROUP BY device").fetchall():
        trials = q("SELECT COUNT(*) FROM trials WHERE device=?", (dev,)).fetchone()[0]
        tuned = q("SELECT dtype, acc, COUNT(*) FROM tuning WHERE device=? AND impl='gemmrl-tuned' "
                  "GROUP BY dtype, acc ORDER BY dtype DESC, acc", (dev,)).fetchall()
        click.echo(f"  {dev}: {n_meas} measurements of {n_shapes} (shape, input, accumulator) problems, {trials} "
                   "trials, tuned: " + (", ".join(f"{n} shapes ({d} in, acc {a})" for d, a, n in tuned) or "none"))
    store.close()
    if compress:
        try:
            out = pack(db, small=small)
        except StoreError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


@main.command(name="build")
@click.option("--shapes", "shape_spec", default="subset", show_default=True,
              help="grid | subset | subset:N | preset:NAME | FILE | MxNxK[,MxNxK...]")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--family", "family_opts", multiple=True, default=None,
              help="kernel family (repeat for several)  [default: cutlass_sm90; with --tuned-in: all]")
@click.option("--layouts", default="NN,TN", show_default=True)
@click.option("--top", default=4, show_default=True, type=click.IntRange(1, 1000),
              help="candidates per family, layout and shape")
@click.option("--tuned-in", "tuned_db", default=None, metavar="DB",
              help="compile the winners `gemmrl tune` stored in this store instead (every device, dtype and "
                   "accumulator; --shapes, if given, keeps those shapes' alone and compiles in its order; --dtype, "
                   "--acc, --layouts and --top are not used): what `gemmrl bench --impl tuned` and a pack load, "
                   "ready before a GPU session")
@click.option("--device", "tuned_device", default=None, metavar="NAME",
              help="with --tuned-in: only the winners tuned on this GPU model (as torch names it, or a unique "
                   "part of the name: H200)")
@click.option("--variants", "variant_opt", default=None, metavar="FIELDS",
              help="with --tuned-in: also each CUTLASS winner's neighbours in these fields (comma-separated: "
                   "raster, swizzle, stages, epilogue, pdl, cluster, lean, epi, splits, resident), for a --built-only search "
                   "around the winners or a race of them (bench --impl race:K:built:FIELD)")
@click.option("--acc-only", "acc_only", default=None, type=click.Choice(["fp32", "fp16"]),
              help="with --tuned-in: only the winners of this accumulator")
@click.option("--jobs", default=None, type=click.IntRange(1, 1024), help="parallel nvcc processes (default: CPUs)")
@click.option("--dry-run", is_flag=True, help="list what would be compiled, compile nothing")
@click.option("--pending-in", "pending_db", default=None, metavar="DB",
              help="leave out the shapes that already have --candidates trials in this store (any GPU): "
                   "those a tune run with as many candidates would not search again")
@click.option("--candidates", default=8, show_default=True, type=click.IntRange(1, 10000),
              help="with --pending-in: the tune run's candidates per shape")
@click.option("--max-shapes", default=None, type=click.IntRange(1, 100000),
              help="only the first N shapes (after --pending-in): what one tune call will reach")
@click.option("--entries", "entries_file", default=None, metavar="FILE",
              help="also write the build-cache directory of every kernel planned (built or not, relative to "
                   "$GEMMRL_CACHE), one a line: what scripts/pack-build-cache.sh packs for a device call")
@click.option("--race", "race_k", default=None, type=click.IntRange(1, 64),
              help="with --tuned-in: also the kernels `bench --impl race:K` races on each shape (the "
                   "search's fastest K within 10%, and the incumbent winner)")
@click.option("--former", "former", default=None, type=click.IntRange(1, 16),
              help="with --race: also the N winners verified before each incumbent (what `bench --impl "
                   "race:K:formerN` races)")
@click.option("--burst", "burst", default=None, type=click.IntRange(1, 16),
              help="with --race: also the N fastest kernels of each shape whose only trials were burst-timed, "
                   "never beside the baseline (what `bench --impl race:K:burstN` races)")
@click.option("--match", "match", default=None, metavar="REGEX",
              help="each family's candidates are its search pool's kernels whose names match this regular "
                   "expression (re.search), the cost model's fastest --top of them: what `gemmrl tune --match "
                   "REGEX --built-only` will find built (e.g. '_128x160x' for cuBLASLt's big-output tile)")
@click.option("--transfer-from", "transfer_text", multiple=True, metavar="GPU[:[IN/]ACC]",
              help="with --tuned-in: compile what `gemmrl tune --transfer-from GPU[:[IN/]ACC]` proposes first on "
                   "--shapes with --dtype and --acc: per shape the first --top of that GPU's winner and runners-up "
                   "(with :ACC, its tuning with that accumulator, each kernel's --acc twin; with :IN/ACC, its "
                   "tuning of IN inputs too, each kernel's --dtype twin; repeated, the sources "
                   "interleaved by rank, as tune does). tune takes 3")
@click.option("--seed-from-lt", "lt_gpu", default=None, metavar="GPU",
              help="with --tuned-in: also compile what `gemmrl tune --seed-from-lt` proposes first on GPU: "
                   "the kernels of cuBLASLt autotuned's stored choices there on --shapes (ranked before any "
                   "--transfer-from's, as tune does), less those the store has trials of there")
@click.option("--pack", "pack_dir", default=None, metavar="DIR",
              help="compile every kernel of this pack instead (what gemmrl.warmup() builds on the GPU "
                   "machine): a deployment's cache made ahead of time; only --shapes (then only the kernels "
                   "serving those shapes: what a bench of them loads), --jobs, --dry-run and --entries apply")
def build_cmd(shape_spec, dtype, acc, family_opts, layouts, top, tuned_db, tuned_device, variant_opt, acc_only, jobs,
              dry_run, pending_db, candidates, max_shapes, entries_file, race_k, former, burst, match, transfer_text,
              lt_gpu, pack_dir):
    """Compile the kernels a set of shapes will try into the build cache ($GEMMRL_CACHE), ahead of
    time and without a GPU; copy the cache to the GPU machine to save its time."""
    from gemmrl.build import ahead
    from gemmrl.space import registry

    if pack_dir is not None:
        ctx = click.get_current_context()
        given = [opt for n, opt in (("tuned_db", "--tuned-in"), ("pending_db", "--pending-in"),
                                    ("race_k", "--race"), ("former", "--former"), ("burst", "--burst"),
                                    ("max_shapes", "--max-shapes"),
                                    ("tuned_device", "--device"),
                                    ("match", "--match"))
                 if ctx.get_parameter_source(n) is not ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--pack builds the pack's kernels: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply")
        from gemmrl.runtime.pack import load_pack

        try:
            pack = load_pack(pack_dir)
        except (FileNotFoundError, ValueError) as e:
            raise click.ClickException(str(e) if str(pack_dir) in str(e) else f"{pack_dir}: {e}") from None
        if ctx.get_parameter_source("shape_spec") is ParameterSource.DEFAULT:
            return _compile_jobs(ahead.plan_pack(pack), f"the {len(pack.entries)} entries of {pack_dir}", jobs,
                                 dry_run, entries_file)
        wanted = {(p.M, p.N, p.K) for p in _problems(shape_spec, dtype, acc)}
        mine = [e for e in pack.entries if (e.problem.M, e.problem.N, e.problem.K) in wanted]
        return _compile_jobs(ahead.plan_pack(pack, mine),
                             f"the {len(mine)} entries of {pack_dir} serving {len(wanted)} shapes", jobs, dry_run,
                             entries_file)

    for opt, given in (("--device", tuned_device), ("--variants", variant_opt), ("--acc-only", acc_only),
                       ("--race", race_k)):
        if given is not None and tuned_db is None:
            raise click.UsageError(f"{opt} goes with --tuned-in")
    if former is not None and race_k is None:
        raise click.UsageError("--former goes with --race")
    if burst is not None and race_k is None:
        raise click.UsageError("--burst goes with --race")
    if match is not None and tuned_db is not None:
        raise click.UsageError("--match picks from the search pool; --tuned-in builds stored winners: choose one")
    _check_match(match)
    fields = tuple(f.strip() for f in (variant_opt or "").split(",") if f.strip())
    if set(fields) - set(ahead.VARIANT_FIELDS):
        raise click.BadParameter(f"fields are {', '.join(ahead.VARIANT_FIELDS)}; got {variant_opt!r}",
                                 param_hint="--variants")
    try:
        fams = [registry.get(f) for f in family_opts or (() if tuned_db else ("cutlass_sm90",))]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--family") from None
    if transfer_text or lt_gpu:
        if tuned_db is None:
            raise click.UsageError(f"{'--transfer-from' if transfer_text else '--seed-from-lt'} goes with --tuned-in "
                                   "DB, the store holding that tuning")
        return _build_transfer(tuned_db, transfer_text, shape_spec, dtype, acc, top, fams, tuned_device,
                               variant_opt, acc_only, race_k, pending_db, max_shapes, jobs, dry_run, entries_file,
                               lt_gpu)
    if tuned_db is not None:
        if pending_db is not None or max_shapes is not None:
            raise click.UsageError("--tuned-in builds stored winners: --pending-in and --max-shapes do not apply")
        from gemmrl.search.run import TUNED
        from gemmrl.store.db import Store, device_by_part, unpack_if_missing

        unpack_if_missing(tuned_db)
        if not Path(tuned_db).exists():
            raise click.ClickException(f"no store at {tuned_db}")
        store = Store(tuned_db, readonly=True)
        if tuned_device:  # the GPU named, or the only one of the store's tuned GPUs whose name holds it
            try:
                tuned_device = device_by_part(tuned_device, store.tuned_devices(TUNED), "GPUs")
            except ValueError as e:
                store.close()
                raise click.ClickException(str(e)) from None
        choices = [c for c in store.tuned_choices(TUNED, tuned_device) if acc_only in (None, c[1].acc)]
        if click.get_current_context().get_parameter_source("shape_spec") is not ParameterSource.DEFAULT:
            # in the order --shapes gives them (a list written smallest first compiles its first shapes'
            # winners first, so a build cut short, or one still running, serves a prefix of the list)
            wanted = {}
            for p in _problems(shape_spec, dtype, acc):
                wanted.setdefault((p.M, p.N, p.K), len(wanted))
            choices = sorted((c for c in choices if (c[1].M, c[1].N, c[1].K) in wanted),
                             key=lambda c: wanted[(c[1].M, c[1].N, c[1].K)])
        if not choices:
            store.close()
            raise click.ClickException(f"{tuned_db} holds no {TUNED} winners"
                                       + (f" on {tuned_device!r}" if tuned_device else "")
                                       + (f" with a {acc_only} accumulator" if acc_only else ""))
        jobs_all, skipped = ahead.plan_tuned(choices, {f.name for f in fams} if fams else None, fields)
        if race_k:
            jobs_all = ahead.unique(jobs_all + ahead.plan_race(store, choices, race_k,
                                                               {f.name for f in fams} if fams else None,
                                                               former=former or 0, burst=burst or 0))
        store.close()
        for line in skipped:
            click.echo(f"skipped: {line}", err=True)
        return _compile_jobs(jobs_all, f"the winners of {len(choices)} tuned (shape, precision) pairs"
                             + (f" and their {', '.join(fields)} variants" if fields else "")
                             + (f" and the race's {race_k} contenders" if race_k else "")
                             + (f" and the {former} winners before each incumbent" if former else "")
                             + (f" and the {burst} fastest burst-only kernels" if burst else ""), jobs, dry_run,
                             entries_file)
    problems = _problems(shape_spec, dtype, acc)
    if pending_db is not None:
        from gemmrl.store.db import Store, unpack_if_missing

        unpack_if_missing(pending_db)
        if not Path(pending_db).exists():
            raise click.ClickException(f"no store at {pending_db}")
        store = Store(pending_db, readonly=True)
        tried = store.trial_counts()
        store.close()
        problems = [p for p in problems if tried.get(p.key(), 0) < candidates]
    if max_shapes is not None:
        problems = problems[:max_shapes]
    if not problems:
        click.echo("no shapes left to build for", err=True)
        return
    if pending_db is not None or max_shapes is not None:
        shown = ", ".join(p.shape for p in problems[:8]) + (", ..." if len(problems) > 8 else "")
        click.echo(f"shapes: {shown}", err=True)
    lays = _layouts(layouts)
    if match is not None:
        planned = ahead.plan_match(problems, fams, lays, top, match)
        if not planned:
            raise click.ClickException(f"no kernel of the search pool ({', '.join(f.name for f in fams)}) matches "
                                       f"{match!r} on these shapes")
        return _compile_jobs(planned, f"{len(problems)} shapes (kernels matching {match!r})", jobs, dry_run,
                             entries_file)
    _compile_jobs(ahead.plan(problems, fams, lays, top), f"{len(problems)} shapes", jobs, dry_run, entries_file)


def _build_transfer(tuned_db, transfer_texts, shape_spec, dtype, acc, top, fams, tuned_device, variant_opt,
                    acc_only, race_k, pending_db, max_shapes, jobs, dry_run, entries_file, lt_gpu=None):
    """build --tuned-in DB --transfer-from GPU[:ACC] and/or --seed-from-lt GPU ...: the kernels
    tune's prior puts first."""
    from gemmrl.build import ahead
    from gemmrl.search.run import TUNED, merged_priors, store_prior
    from gemmrl.store.db import Store, unpack_if_missing

    given = [opt for opt, v in (("--device", tuned_device), ("--variants", variant_opt), ("--acc-only", acc_only),
                                ("--race", race_k), ("--pending-in", pending_db), ("--max-shapes", max_shapes))
             if v is not None]
    if given:
        raise click.UsageError(f"{'--transfer-from' if transfer_texts else '--seed-from-lt'} builds the prior's "
                               f"kernels: {', '.join(given)} "
                               f"{'does' if len(given) == 1 else 'do'} not apply")
    unpack_if_missing(tuned_db)
    if not Path(tuned_db).exists():
        raise click.ClickException(f"no store at {tuned_db}")
    problems = _problems(shape_spec, dtype, acc)
    store = Store(tuned_db, readonly=True)
    names, priors, twins, typed = [], [], False, False
    try:
        devices = store.tuned_devices(TUNED)
        for text in transfer_texts:
            source, source_acc, source_dtype = split_transfer_source(text)
            source = _known_device(source, devices, f"{tuned_db} holds no {TUNED} winners on {source!r}")
            cross, cross_dtype = source_acc not in (None, acc), source_dtype not in (None, dtype)
            twins, typed = twins or cross, typed or cross_dtype
            priors.append(store_prior(store, source, problems, source_acc, acc, source_dtype, dtype))
            names.append(f"{source}'s" + (f" {source_dtype}" if source_dtype else "")
                         + (f" {source_acc}" if source_acc else ""))
        if lt_gpu is not None:  # first, as tune ranks it
            from gemmrl.search.lt_seed import lt_devices, lt_prior, untried

            lt_device = _known_device(lt_gpu, lt_devices(store), f"{tuned_db} holds no autotuned cuBLASLt choices "
                                      f"on {lt_gpu!r} (gemmrl bench --impl baselines stores them)")
            tiles, clusters, _src = _lt_tables()
            priors.insert(0, lt_prior(store, lt_device, problems, tiles, clusters))
            names.insert(0, f"cuBLASLt autotuned's (on {lt_device})")
        prior = merged_priors(priors)
        if lt_gpu is not None:  # the tune runs on that GPU: it offers what it has not tried there yet
            prior = untried(prior, store, lt_device)
    finally:
        store.close()
    what = " and ".join(names)
    if not prior:
        raise click.ClickException(f"the tuning ({what}) suggests nothing for these {len(problems)} shapes"
                                   + (" that the search has not tried there" if lt_gpu is not None else ""))
    return _compile_jobs(ahead.plan_transfer(prior, top, {f.name for f in fams} if fams else None),
                         f"the first {top} of {what} suggestions"
                         + (" not tried there yet" if lt_gpu is not None else "")
                         + f" on {len(prior)} of {len(problems)} shapes"
                         + (f" as {dtype}-input, {acc}-accumulator twins" if typed else
                            f" as {acc}-accumulator twins" if twins else ""),
                         jobs, dry_run, entries_file)


def _check_match(match: str | None) -> None:
    """--match (tune, build): a regular expression, or a usage error saying why not."""
    if match is None:
        return
    import re

    try:
        re.compile(match)
    except re.error as e:
        raise click.BadParameter(f"not a regular expression: {e}", param_hint="--match") from None


def _compile_jobs(jobs_all, what: str, jobs, dry_run, entries_file=None) -> None:
    """Compile the jobs not in the build cache yet, in parallel, with progress; exit non-zero if
    any failed (their logs printed). `entries_file`: where to list every job's cache directory."""
    from gemmrl.build import ahead
    from gemmrl.build.pool import build_many

    if entries_file:
        Path(entries_file).write_text("".join(f"{e}\n" for e in ahead.entries(jobs_all)))

    todo = ahead.pending(jobs_all)
    click.echo(f"{len(jobs_all)} distinct kernels for {what}; {len(jobs_all) - len(todo)} "
               f"already built, {len(todo)} to compile", err=True)
    if dry_run:
        for j in todo:
            click.echo(j.name)
        return
    t0, failed = time.monotonic(), []

    def progress(done, total, name, r):
        el = time.monotonic() - t0
        eta = el / done * (total - done)
        click.echo(f"[{done}/{total}] {'ok  ' if r.ok else 'FAIL'} {name} ({r.seconds:.0f} s)  "
                   f"elapsed {el:.0f}s eta {eta:.0f}s", err=True)
        if not r.ok:
            failed.append((name, r.log[-1500:]))
    build_many([j.as_tuple() for j in todo], workers=jobs, progress=progress)
    for name, log in failed:
        click.echo(f"--- {name} failed:\n{log}", err=True)
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(todo)} builds failed")


@main.command(name="verify")
@click.option("--impl", "impl_opts", multiple=True, required=True)
@click.option("--shapes", "shape_spec", default="256x384x512", show_default=True)
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16"]))
@click.option("--acc", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--residues", is_flag=True, help="also shapes that are not multiples of any tile")
@click.option("--include", "include_dirs", multiple=True, help="include directory for kernel: builds")
def verify_cmd(impl_opts, shape_spec, dtype, acc, residues, include_dirs):
    """Run every correctness check on implementations; exit 1 if any is rejected."""
    problems = _problems(shape_spec, dtype, acc)
    from gemmrl.bench import runner

    runner.require_gpu()
    from gemmrl.verify.checks import residue_problems, verify

    try:
        impls = build_impls(impl_opts, include_dirs=include_dirs)
    except Exception as e:  # a kernel that does not build or load is a rejection with its log
        click.echo(json.dumps({"impl": " ".join(impl_opts), "passed": False,
                               "reason": f"{type(e).__name__}: {e}"[-3000:]}))
        sys.exit(1)
    bad = 0
    for impl in impls:
        for p in problems:
            for q in (residue_problems(p) if residues else [p]):
                if not impl.supports(q):
                    continue
                r = verify(impl, q)
                click.echo(json.dumps({"impl": impl.name, "shape": q.shape, "passed": r.passed,
                                       "reason": r.reason, "rel_err": r.details.get("rel_err")}))
                bad += not r.passed
                if not r.passed:  # after a sticky CUDA error every later check would fail too
                    from gemmrl.bench.worker import CudaContextLost, stop_if_context_lost

                    try:
                        stop_if_context_lost(f"{impl.name} on {q.shape}")
                    except CudaContextLost as e:
                        click.echo(f"error: {e}; the checks after it were not run", err=True)
                        sys.exit(1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
