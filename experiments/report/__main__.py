"""`python -m experiments.report ROOT`: the report of every run under ROOT (see the
package's docstring, or --help)."""

from experiments.report import main

main()
