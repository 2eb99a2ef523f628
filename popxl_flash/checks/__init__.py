"""Checking and measuring tools: the self-check (`selfcheck`, `copycheck`), the tolerance
rule (`tolerance`), the float64 reference (`reference`), naive PopXL attention (`naive`), the
run harness (`harness`), devices (`devices`) and shared CLI value types (`cli`)."""
