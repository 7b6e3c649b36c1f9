"""Sum pytest JUnit reports into one closing line: ``tests: N passed, N failed, N skipped``."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(paths: list) -> int:
    passed = failed = skipped = 0
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as err:
            print(f"tests: no report from {path} ({err}); that run died", file=sys.stderr)
            failed += 1
            continue
        for suite in root.iter("testsuite"):
            tests, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skip = int(suite.get("skipped", 0))
            passed += tests - fail - skip
            failed += fail
            skipped += skip
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
