"""ucp's version, at the bottom of the package so that any layer may stamp it into what it writes."""

__all__ = ["VERSION"]

VERSION = "0.1.0"
