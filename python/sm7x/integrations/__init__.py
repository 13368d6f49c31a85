"""Adapters that plug sm7x into other engines (one subpackage per engine).

Importing this package, or an engine's subpackage, imports neither torch nor the engine:
the engine's own plugin loader imports what it needs when it loads sm7x.
"""
