# The files here are dejax's own tests, kept verbatim; they import `dejax`, which is not
# installed. tests/test_compat_dejax_upstream.py runs them with `dejax` bound to
# dejax_eqx.compat.dejax, so pytest must not collect them on its own.
collect_ignore_glob = ["test_*.py"]
