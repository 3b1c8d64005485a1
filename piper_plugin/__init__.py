"""Piper: a programmable distributed-training engine (annotations -> directives -> DAG -> plans)."""
from piper_plugin.api.annotate import annotate, annotate_modules
from piper_plugin.ir.capture import Program, capture

__all__ = ["annotate", "annotate_modules", "capture", "Program"]
