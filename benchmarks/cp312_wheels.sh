# Sourced by gpu_deps.sh and gpu4pyscf_deps.sh: cp312_wheels DIR SPEC... downloads the CPython 3.12
# x86-64 Linux wheels of SPEC... (no dependencies) into DIR, with $python's pip.
cp312_wheels() {
    local dir="$1"
    shift
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$@"
}
