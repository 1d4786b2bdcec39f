"""Autoscaling from Prometheus saturation signals: the pure decision (``policy``) and its PromQL (``queries``)."""
