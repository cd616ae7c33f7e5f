"""Lazy tensor references and the bytes behind them; dtypes; the content fingerprint."""
