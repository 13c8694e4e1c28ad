"""A cheap view of a running parameter server for progress displays (the live bar, the notebook widget)."""
from __future__ import annotations

from typing import cast

from sparkdl._internal.ps.server.core import PSCore
from sparkdl._internal.ps.server.runlog import UpdateRow


def run_progress(core: PSCore) -> dict:
    """Pushes against their plan, samples against the budget, the epoch, the recent loss, staleness and rate."""
    members, config, log = core.members, core.config, core.log
    updates = log.updates
    last = updates[-1] if updates else None
    recent = log.gradients[-200:]
    budget = members.sample_budget
    # Under a global sample budget a fast worker may start another pass over its partition while the
    # others finish theirs: the run's epoch is the share of the budget consumed, not that worker's pass.
    epoch = (min(config.epochs - 1, members.samples_consumed * config.epochs // budget) if budget
             else last.epoch if last else 0)
    return {"pushes": sum(members.positions()), "planned_pushes": members.planned_pushes(), "version": core.version,
            "samples_consumed": members.samples_consumed, "sample_budget": budget,
            "epoch": epoch, "loss": last.loss if last else float("nan"),
            "samples": sum(row.samples for row in updates[-50:]),
            "window_s": (cast(UpdateRow, last).time_s - updates[-50].time_s) if len(updates) >= 50 else None,
            "staleness": sum(r.staleness for r in recent) / len(recent) if recent else 0.0,
            "retries": core.stats.rejoins, "joins": core.stats.late_joins,
            # work units: the tasks training now (executors come and go)
            "workers": members.active if members.units else None,
            "val_loss": log.validation[-1].val_loss if log.validation else None,
            # the newest completed epoch's trainStep metrics (the loss is shown above)
            "metrics": ({k: v for k, v in log.epochs[-1].metrics.items() if k != "loss"} if log.epochs else {})}
