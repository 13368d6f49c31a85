"""One rich console for the whole build (progress, tables, errors)."""
from rich.console import Console

console = Console(highlight=False)
