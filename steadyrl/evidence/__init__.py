"""Evidence from a run's logs: read them (``history``), name what went wrong (``doctor``), plot them (``report``).

``report`` imports matplotlib, so it is not imported here: ``from steadyrl.evidence.report import write_report``.
"""

from steadyrl.evidence.doctor import DoctorConfig, Evidence, Finding, diagnose, format_findings
from steadyrl.evidence.history import History, HistoryNotFoundError, load_history

__all__ = [
    "DoctorConfig",
    "Evidence",
    "Finding",
    "History",
    "HistoryNotFoundError",
    "diagnose",
    "format_findings",
    "load_history",
]
