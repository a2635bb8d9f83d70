"""The artifact format, one implementation for compile, run, train and plan.

    from ernie_ir.artifacts import read_manifest, verify_artifact, load_rank_graphs
    manifest = verify_artifact("art")          # every file's sha256, the tree's shape
    mapping, graphs = load_rank_graphs("art")  # rank graphs, weights memory-mapped

`manifest`: the manifest's schema, reading, verifying, loading and writing it.
`writer`: writing a compiled artifact (`write_artifact`, `ArtifactContents`, `check_out`).
`publish`: writing a folder next to others safely (a lock per destination,
temp folders, the final move, cleanup of what killed writers left).

Layering: this package imports only `ernie_ir.ir`; `runtime` and `targets`
both import it (targets writes artifacts, runtime reads them), so runtime never
imports targets.
"""

from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    FORMATS,
    MANIFEST,
    ArtifactError,
    Manifest,
    ManifestRecord,
    artifact_mapping,
    build_manifest,
    check_files,
    check_rank_graphs,
    hash_tree,
    load_artifact,
    load_rank_graphs,
    parse_manifest,
    read_manifest,
    read_manifest_data,
    record_files,
    require_weights,
    validate_manifest,
    verify_artifact,
    write_manifest,
)
from .publish import (
    artifact_lock,
    clean_stale,
    make_temp_dir,
    move_into_place,
    publish_into,
    temp_name,
    test_pause,
)
from .writer import ArtifactContents, check_out, write_artifact

__all__ = [
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "MANIFEST",
    "ArtifactContents",
    "ArtifactError",
    "Manifest",
    "ManifestRecord",
    "artifact_lock",
    "artifact_mapping",
    "build_manifest",
    "check_files",
    "check_out",
    "check_rank_graphs",
    "clean_stale",
    "hash_tree",
    "load_artifact",
    "load_rank_graphs",
    "make_temp_dir",
    "move_into_place",
    "parse_manifest",
    "publish_into",
    "read_manifest",
    "read_manifest_data",
    "record_files",
    "require_weights",
    "temp_name",
    "test_pause",
    "validate_manifest",
    "verify_artifact",
    "write_artifact",
    "write_manifest",
]
