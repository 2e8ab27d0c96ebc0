"""Traces (OpenTelemetry, OTLP), metrics (Prometheus) and GPU figures (NVML) of every Tandem process."""
