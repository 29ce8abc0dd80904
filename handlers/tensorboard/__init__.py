"""TensorBoardMetrics and its parts: the handler (``metrics``), the per-log scalar handlers (``scalars``), one
event per log (``event``), what ran as text and HParams (``facts``) and the end-of-run health summary (``health``).
"""
