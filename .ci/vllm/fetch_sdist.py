"""Download one source distribution (sdist) from the package index that pip is configured for.

Usage: PEER_PY fetch_sdist.py NAME VERSION DEST_DIR [SHA256]

Why this script, and not `pip download --no-deps --no-binary=:all: NAME==VERSION -d DEST`:
pip download prepares the metadata of every sdist it fetches. For vLLM that means a PEP 517
build environment with vLLM's build requirements (cmake, setuptools-rust, torch==2.14.0, ...).
With --no-binary=:all: those are built from source too, and torch has no sdist, so the
command fails (ResolutionImpossible). Without --no-binary it installs the CUDA torch into a
temporary build environment (gigabytes). The tests need only the tarball.

This script asks pip's own package finder for the sdist, with pip's own option parsing
(pip.conf, PIP_* environment variables: index URLs, find-links, certificates, proxies),
downloads the file with pip's HTTP session and checks the hash. It does not build anything.
It uses pip internals (pip._internal) that have been stable from pip 20 to pip 25.
Prints the path of the file it wrote.
"""

import hashlib
import os
import sys

from pip._internal.commands import create_command
from pip._vendor.packaging.specifiers import SpecifierSet


def main() -> int:
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    name, version, dest = sys.argv[1], sys.argv[2], sys.argv[3]
    want_sha = sys.argv[4].lower() if len(sys.argv) == 5 else None
    os.makedirs(dest, exist_ok=True)

    cmd = create_command("download")
    options, _ = cmd.parse_args(
        ["--no-deps", "--no-binary=:all:", "-d", dest, f"{name}=={version}"]
    )
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session)
        best = finder.find_best_candidate(name, SpecifierSet(f"=={version}")).best_candidate
        if best is None:
            print(
                f"fetch_sdist: no sdist of {name}=={version} on the configured index",
                file=sys.stderr,
            )
            return 1
        link = best.link
        if not link.filename.endswith((".tar.gz", ".zip")):
            print(f"fetch_sdist: best candidate is not an sdist: {link.filename}", file=sys.stderr)
            return 1
        out = os.path.join(dest, link.filename)
        tmp = out + ".part"
        h = hashlib.sha256()
        print(
            f"fetch_sdist: downloading {link.filename} from {link.netloc or 'local index'}",
            file=sys.stderr,
        )
        resp = session.get(
            link.url_without_fragment, stream=True, headers={"Accept-Encoding": "identity"}
        )
        resp.raise_for_status()
        with open(tmp, "wb") as f:
            for chunk in resp.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                h.update(chunk)
        got = h.hexdigest()
        if link.hash_name == "sha256" and link.hash and link.hash.lower() != got:
            os.remove(tmp)
            print(f"fetch_sdist: sha256 {got} != index's {link.hash}", file=sys.stderr)
            return 1
        if want_sha and want_sha != got:
            os.remove(tmp)
            print(f"fetch_sdist: sha256 {got} != expected {want_sha}", file=sys.stderr)
            return 1
        os.replace(tmp, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
