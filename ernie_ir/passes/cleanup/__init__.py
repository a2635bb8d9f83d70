"""Generic cleanup passes: `canonicalize`, `cse` (common subexpressions), `dce` (dead code)."""
