"""One rich console for all the tools (progress, tables, errors)."""
from rich.console import Console

console = Console(highlight=False)
