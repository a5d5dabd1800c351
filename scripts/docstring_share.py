"""Docstring and comment lines of the product code (pallas_kernels/ and
torch_bridge/): their share of all lines, and the median and longest module
docstring. A line counts once if it is in any docstring or holds a comment.

    python3 scripts/docstring_share.py [ROOT] [-v]
"""
import ast
import io
import pathlib
import statistics
import sys
import tokenize

PACKAGES = ("pallas_kernels", "torch_bridge")


def measure(path):
  """(lines, docstring or comment lines, module docstring lines)."""
  src = path.read_text()
  marked, module_doc = set(), 0
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)) and ast.get_docstring(node, False):
      first = node.body[0]
      marked.update(range(first.lineno, first.end_lineno + 1))
      if isinstance(node, ast.Module):
        module_doc = first.end_lineno - first.lineno + 1
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type == tokenize.COMMENT:
      marked.add(tok.start[0])
  return len(src.splitlines()), len(marked), module_doc


def main(argv):
  root = pathlib.Path(next((a for a in argv if a != "-v"), "."))
  rows = [(str(p.relative_to(root)),) + measure(p) for package in PACKAGES
          for p in sorted((root / package).rglob("*.py"))]
  for scope in PACKAGES + ("all",):
    sel = [r for r in rows if scope == "all" or r[0].startswith(scope + "/")]
    lines, doc = sum(r[1] for r in sel), sum(r[2] for r in sel)
    module = [r[3] for r in sel if r[3]]
    print(f"{scope}: {len(sel)} files, {lines} lines, {doc} docstring/comment "
          f"({100 * doc / lines:.1f}%), module docstring median "
          f"{statistics.median(module):g}, max {max(module)}")
  if "-v" in argv:
    for name, _, _, module_doc in sorted(rows, key=lambda r: -r[3])[:15]:
      print(f"  {module_doc:4d}  {name}")


if __name__ == "__main__":
  main(sys.argv[1:])
