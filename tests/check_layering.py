#!/usr/bin/python3
"""The layering of the libraries, checked on the sources.

    check_layering.py SOURCE_DIR LIB:FLOOR:DIR[,DIR...] ... [--generated HEADER:LIB ...]

Every header and source of a library may include KokkosMoE headers of its
own library and of libraries on lower floors only (a library never reaches
up, nor sideways to another library of its floor), and a library's impl/
headers only from its own files. Apps (floor 5) may include any public
header but no impl/ or tpls/ header (vendor specializations, private like impl/). Prints every violation with file and line; exits
non-zero when there is one.
"""

import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*<((?:impl/|tpls/)?KokkosMoE_[A-Za-z0-9_]+\.hpp)>')


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    root = argv[1]
    libs = {}       # name -> (floor, [dirs])
    owner = {}      # include name ("KokkosMoE_X.hpp" or "impl/KokkosMoE_X.hpp") -> library
    args = argv[2:]
    generated = []
    if "--generated" in args:
        i = args.index("--generated")
        generated = args[i + 1:]
        args = args[:i]
    for spec in args:
        name, floor, dirs = spec.split(":", 2)
        libs[name] = (int(floor), [os.path.join(root, d) for d in dirs.split(",")])
    for name, (_, dirs) in libs.items():
        for d in dirs:
            for sub in ("", "impl", "tpls"):
                folder = os.path.join(d, sub)
                if not os.path.isdir(folder):
                    continue
                for f in sorted(os.listdir(folder)):
                    if f.endswith(".hpp"):
                        key = os.path.join(sub, f) if sub else f
                        if key in owner and owner[key] != name:
                            print(f"check_layering: {key} is in both {owner[key]} and {name}")
                            return 1
                        owner[key] = name
    for g in generated:
        header, lib = g.split(":")
        owner[header] = lib

    files = []
    for name, (_, dirs) in libs.items():
        for d in dirs:
            for dirpath, _, names in os.walk(d):
                if os.path.relpath(dirpath, d) not in (".", "impl", "tpls"):
                    continue
                files += [(name, os.path.join(dirpath, f)) for f in sorted(names) if f.endswith((".hpp", ".cpp"))]
    apps = os.path.join(root, "apps")
    for dirpath, _, names in os.walk(apps):
        files += [("apps", os.path.join(dirpath, f)) for f in sorted(names) if f.endswith((".hpp", ".cpp"))]

    problems = []
    checked = 0
    for lib, path in files:
        floor = 5 if lib == "apps" else libs[lib][0]
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                header = m.group(1)
                checked += 1
                target = owner.get(header)
                where = f"{os.path.relpath(path, root)}:{number}"
                if target is None:
                    problems.append(f"{where}: <{header}> belongs to no library")
                    continue
                if header.startswith(("impl/", "tpls/")) and target != lib:
                    problems.append(f"{where}: <{header}> is private to {target} ({header.split('/')[0]}/), included from {lib}")
                    continue
                if target == lib:
                    continue
                tfloor = libs[target][0]
                if tfloor >= floor:
                    kind = "above" if tfloor > floor else "beside"
                    problems.append(f"{where}: {lib} (floor {floor}) includes <{header}> of {target} (floor {tfloor}), a library {kind} it")
    for p in problems:
        print(p)
    print(f"check_layering: {len(files)} files, {checked} includes of library headers, {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
