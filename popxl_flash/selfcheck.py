"""``python -m popxl_flash.selfcheck``: the self-check's command (see
:mod:`popxl_flash.checks.selfcheck`)."""
from popxl_flash.checks.selfcheck import main

if __name__ == "__main__":
    raise SystemExit(main())
