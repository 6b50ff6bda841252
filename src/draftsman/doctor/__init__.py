"""`draftsman doctor`: why is acceptance low? Static checks of a (target, drafter) pair, the
acceptance the drafter should get (teacher-forced on the target's own answers), the same score
under plausible wrong conventions, the acceptance an engine does get, and whether it pays.

  checks.py  static checks (pure functions over configs and tensors)
  load.py    a drafter loader that keeps going past the faults it reports
  score.py   teacher-forced scoring and the replayed greedy chain
  probes.py  the wrong conventions tried, and the rules that name a cause
  live.py    draftsman's engine, an external server, step costs
  verdict.py the live and pay checks, and the verdict that names a cause
  core.py    `diagnose`: all of it, for one target and one or more drafters
  report.py  the text report
"""

from draftsman.doctor.checks import FAIL, PASS, SKIP, WARN, Check
from draftsman.doctor.core import DoctorError, DoctorOptions, diagnose
from draftsman.doctor.live import SIMULATIONS
from draftsman.doctor.report import format_report

__all__ = ["FAIL", "PASS", "SIMULATIONS", "SKIP", "WARN", "Check", "DoctorError", "DoctorOptions", "diagnose",
           "format_report"]
