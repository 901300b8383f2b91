"""The contract every backend of :class:`caffe2ckpt.fs.location.Location` keeps, as one suite
that each backend's test class mixes in with its own fixture (fsspec's habit): a local disk, a
local disk behind an fsspec wrapper (the generic class), ``memory://`` and the S3 test servers,
and each of a local disk and the S3 servers behind fsspec's ``DirFileSystem`` (a wrapper the
locations see through: they get the class of the filesystem underneath)."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import time

import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt.errors import CheckpointNotFoundError, InvalidLocationError
from caffe2ckpt.fs import location as location_module
from caffe2ckpt.fs.local import LocalLocation
from caffe2ckpt.fs.location import Location
from caffe2ckpt.fs.remote import FsspecLocation, MemoryLocation, ObjectStoreLocation
from tests.faultfs import FaultyFileSystem


class LocationContract:
    """Tests of the contract; a subclass provides ``location`` (a fresh, empty prefix) and says
    which class it expects."""

    expected_class: type[Location]
    atomic_creates = True  # whether the backend publishes an exclusive create whole

    def test_the_url_picks_the_backend_and_pickling_keeps_it(self, location):
        assert type(location) is self.expected_class
        assert location.atomic_creates is self.atomic_creates
        copy = pickle.loads(pickle.dumps(location))
        assert type(copy) is self.expected_class
        assert (copy.url, copy.root) == (location.url, location.root)

    def test_an_exclusive_create_never_replaces_a_file(self, location):
        path = location.path("_commits", "r.json")
        location.create_exclusive(path, b"first")
        with pytest.raises(FileExistsError):
            location.create_exclusive(path, b"second")
        assert location.read_bytes(path) == b"first"

    def test_a_created_file_that_does_not_parse_waits_only_where_creates_are_not_atomic(
            self, location, monkeypatch):
        """``read_created_json`` of a file made by ``create_exclusive`` that is not JSON (empty:
        what a create that is not atomic shows until its close) refuses it at once (one read,
        whatever a read takes on a loaded machine) where creates are atomic, and only once the
        grace is over (read again meanwhile) where they are not."""
        monkeypatch.setattr(location_module, "CREATE_GRACE", 0.3)
        good, empty = location.path("_runs", "1.json"), location.path("_runs", "2.json")
        location.create_exclusive(good, b'{"a": 1}')
        location.create_exclusive(empty, b"")
        assert location.read_created_json(good) == {"a": 1}
        reads, read_bytes = [], location.read_bytes
        monkeypatch.setattr(location, "read_bytes",
                            lambda path, **kw: reads.append(path) or read_bytes(path, **kw))
        started = time.monotonic()
        with pytest.raises(ValueError, match="Expecting value"):
            location.read_created_json(empty)
        waited = time.monotonic() - started
        if self.atomic_creates:
            assert reads == [empty], reads
        else:
            assert len(reads) > 1 and 0.25 <= waited < 5, (reads, waited)

    def test_a_group_path_is_taken_once(self, location):
        group = location.path("n.1")
        location.create_group(group, "zarr.json", b"{}", batch=location.sync_batch())
        with pytest.raises(FileExistsError):
            location.create_group(group, "zarr.json", b"other")
        location.makedirs(f"{group}/w")
        location.write_file(f"{group}/w/c.0", [b"ab", memoryview(b"cd")])
        assert location.read_bytes(f"{group}/zarr.json") == b"{}"
        assert location.read_bytes(f"{group}/w/c.0") == b"abcd"
        assert sorted(location.list_names(group)) == ["w", "zarr.json"]

    def test_reads_are_bounded_and_missing_files_say_so(self, location):
        path = location.path("f")
        location.makedirs(location.root)
        location.write_file(path, [b"x" * 100])
        assert location.read_bytes(path, limit=100) == b"x" * 100
        with pytest.raises(ValueError, match="larger than the 99 bytes"):
            location.read_bytes(path, limit=99)
        assert location.size(path) == 100
        out = bytearray(96)
        assert location.read_exact(path, memoryview(out), 4) == b"xxxx" and out == b"x" * 96
        with pytest.raises(ValueError):
            location.read_exact(path, memoryview(bytearray(90)), 4)
        for call in (lambda p: location.read_bytes(p), location.size, location.modified):
            with pytest.raises(CheckpointNotFoundError):
                call(location.path("missing"))
        assert location.list_names(location.path("missing")) == []
        assert location.exists(path) and not location.exists(location.path("missing"))
        assert location.file_exists(path) and not location.file_exists(location.path("missing"))

    def test_listing_after_a_name_lists_exactly_the_names_after_it(self, location):
        directory = location.path("_commits")
        names = [f"{e:012d}.n.g1-{e:04x}.json" for e in range(12)]
        for name in names:
            location.create_exclusive(f"{directory}/{name}", b"{}")
        assert location.list_names_after(directory, f"{9:012d}") == names[9:]
        assert location.list_names_after(directory, names[-1]) == []
        assert location.list_names_after(location.path("missing"), "") == []

    def test_replace_file_replaces_it_whole(self, location):
        path = location.path("_hints", "h.json")
        location.replace_file(path, b"old")
        location.replace_file(path, b"new content")
        assert location.read_bytes(path) == b"new content"
        assert location.list_names(location.path("_hints")) == ["h.json"]

    def test_modified_is_the_stores_clock(self, location):
        path = location.path("t")
        location.makedirs(location.root)
        before = time.time()
        location.write_file(path, [b"t"])
        stamp = location.modified(path)
        assert stamp is None or before - 5 <= stamp <= time.time() + 5

    def test_remove_files_removes_exactly_the_named_files(self, location):
        group = location.path("n.2")
        location.create_group(group, "zarr.json", b"{}")
        location.makedirs(f"{group}/a")
        for name in ("a/zarr.json", "a/c.0", "a/c.1"):
            location.write_file(f"{group}/{name}", [b"."])
        location.write_file(f"{group}/unnamed", [b"someone else's"])
        location.remove_files(group, ["a/c.0", "a/c.1", "a/zarr.json", "zarr.json", "gone"])
        assert location.list_names(group) == ["unnamed"]  # what was not named stays
        location.remove_files(group, ["unnamed"])
        assert not location.exists(group)  # emptied: gone (also a directory an object store kept)
        assert "n.2" not in location.list_names(location.root)

    def test_a_removed_tree_is_gone_from_listings(self, location):
        """No directory of a removed group is left behind, also on an object store whose filer
        keeps emptied directories (SeaweedFS): a later listing would call it unidentified data."""
        group = location.path("n.1.g2-0123")
        location.create_group(group, "zarr.json", b"{}")
        location.makedirs(f"{group}/w")
        location.write_file(f"{group}/w/c.0", [b"c"])
        location.write_file(location.path("keep"), [b"k"])
        location.remove(group)
        assert not location.exists(group)
        assert location.list_names(location.root) == ["keep"]

    def test_remove_never_globs(self, location):
        for group in ("w[12]", "w1", "w2", "a*", "ab"):
            location.create_group(location.path(group), "zarr.json", group.encode())
        location.remove(location.path("w[12]"))
        location.remove(location.path("a*"))
        assert sorted(location.list_names(location.root)) == ["ab", "w1", "w2"]
        location.remove(location.path("missing"))  # not an error

    def test_only_local_disks_have_something_to_flush(self, location):
        batch = location.sync_batch()
        assert (batch is not None) == location.is_local
        created = location.makedirs(location.path("x", "y"), batch=batch)
        location.make_durable(batch, [])
        assert created == ([location.root, location.path("x"), location.path("x", "y")]
                           if location.is_local else [])


LOCAL_WRITES = {  # every LocalLocation write, into directory d
    "makedirs": lambda loc, d: loc.makedirs(f"{d}/sub"),
    "makedirs+batch": lambda loc, d: loc.makedirs(f"{d}/sub", batch=loc.sync_batch()),
    "create_exclusive": lambda loc, d: loc.create_exclusive(f"{d}/r.json", b"r"),
    "create_group": lambda loc, d: loc.create_group(f"{d}/g", "zarr.json", b"{}",
                                                    batch=loc.sync_batch()),
    "replace_file": lambda loc, d: loc.replace_file(f"{d}/h.json", b"h"),
    "write_file": lambda loc, d: loc.write_file(f"{d}/c.0", [b"c"]),
    "write_file+batch": lambda loc, d: loc.write_file(f"{d}/c.0", [b"c"],
                                                      batch=loc.sync_batch()),
}


class TestLocal(LocationContract):
    expected_class = LocalLocation

    @pytest.fixture
    def location(self, tmp_path):
        return Location(str(tmp_path / "prefix"))

    def test_dot_segments_resolve_like_the_os(self, tmp_path):
        assert Location(str(tmp_path / "a" / ".." / "b")).root == str(tmp_path / "b")

    @pytest.mark.parametrize("write", list(LOCAL_WRITES))
    @pytest.mark.parametrize("link", ["_commits", "n.1/w"])
    def test_writes_never_follow_a_symlink_below_the_prefix(self, location, tmp_path, link,
                                                            write):
        """Writes take the reads' walk: a symlinked directory below the prefix (at any depth)
        is refused as an OSError naming it, and nothing is written where it points."""
        outside = tmp_path / "outside"
        outside.mkdir()
        location.makedirs(location.path("n.1"))
        os.symlink(outside, location.path(link))
        with pytest.raises(OSError) as info:
            LOCAL_WRITES[write](location, location.path(link))
        assert info.value.errno == errno.ELOOP
        assert f"{location.path(link)} is a symbolic link" in str(info.value), str(info.value)
        assert list(outside.iterdir()) == []

    def test_a_file_where_a_directory_belongs_is_not_a_directory(self, location):
        location.makedirs(location.root)
        location.write_file(location.path("_runs"), [b"a file"])
        with pytest.raises(NotADirectoryError, match="_runs is not a directory"):
            location.create_exclusive(location.path("_runs", "000000000001.json"), b"{}")

    def test_a_batch_keeps_directories_for_its_writes_and_closes_them(self, location):
        before = set(os.listdir("/proc/self/fd"))
        batch = location.sync_batch()
        location.create_group(location.path("n.1"), "zarr.json", b"{}", batch=batch)
        location.makedirs(location.path("n.1", "w"), batch=batch)
        assert batch.kept_dir(location.path("n.1", "w")) is not None
        location.write_file(location.path("n.1", "w", "c.0"), [b"c"], batch=batch)
        location.make_durable(batch, [])
        assert set(os.listdir("/proc/self/fd")) == before
        assert location.read_bytes(location.path("n.1", "w", "c.0")) == b"c"


class TestWrappedLocalDisk(LocationContract):
    """A local disk behind an fsspec wrapper: the generic class (no os-level paths)."""

    expected_class = FsspecLocation
    atomic_creates = False  # fsspec's local "xb" open makes the file empty, fills it at close

    @pytest.fixture
    def location(self, tmp_path):
        return Location(str(tmp_path / "prefix"), filesystem=FaultyFileSystem(LocalFileSystem()))


class TestDirWrappedLocalDisk(LocationContract):
    """A local disk behind fsspec's DirFileSystem (``filesystem=``): the wrapper only joins
    paths, so the location is the local disk's, at the joined path (os-level I/O, exclusive
    creates by link, durability)."""

    expected_class = LocalLocation

    @pytest.fixture
    def location(self, tmp_path):
        (tmp_path / "root").mkdir()
        wrapper = DirFileSystem(path=str(tmp_path / "root"), fs=LocalFileSystem())
        return Location("prefix", filesystem=wrapper)

    def test_its_root_is_the_joined_local_path(self, location, tmp_path):
        location.create_exclusive(location.path("_runs", "000000000001.json"), b"{}")
        assert location.root == str(tmp_path / "root" / "prefix")
        assert (tmp_path / "root" / "prefix" / "_runs" / "000000000001.json").read_bytes() == b"{}"

    def test_a_dir_url_is_the_same_local_disk(self, tmp_path):
        """``dir::file://...`` (fsspec's URL chaining) names the same joined path as at e4d82ae,
        now as a local disk."""
        wrapped = Location(f"dir::file://{tmp_path}/d")
        assert type(wrapped) is LocalLocation
        assert wrapped.root == f"{tmp_path}/d{tmp_path}/d"  # fsspec repeats the path: its rule
        wrapped.create_exclusive(wrapped.path("_runs", "000000000001.json"), b"{}")
        assert os.listdir(f"{tmp_path}/d{tmp_path}/d/_runs") == ["000000000001.json"]


class TestMemory(LocationContract):
    expected_class = MemoryLocation

    @pytest.fixture
    def location(self, memory_fs):
        return Location("memory://contract")

    def test_dot_segments_are_refused(self, memory_fs):
        with pytest.raises(InvalidLocationError, match="path segments"):
            Location("memory://a/../b")


@pytest.mark.slow
class TestS3(LocationContract):
    expected_class = ObjectStoreLocation

    @pytest.fixture
    def location(self, s3_bucket):
        return Location(f"s3://{s3_bucket}/contract")


@pytest.mark.slow
class TestDirWrappedS3(LocationContract):
    """The S3 servers (moto, SeaweedFS) behind fsspec's DirFileSystem (``filesystem=``): the
    object-store class on the inner s3fs at the joined path, so a removal also deletes the
    ``<path>/`` keys SeaweedFS keeps for emptied directories."""

    expected_class = ObjectStoreLocation

    @pytest.fixture
    def location(self, s3_server, s3_bucket):
        wrapper = DirFileSystem(path=s3_bucket, fs=s3_server.filesystem())
        return Location("contract", filesystem=wrapper)

    def test_a_dir_url_is_the_object_store(self, s3_bucket):
        location = Location(f"dir::s3://{s3_bucket}/d")
        assert type(location) is ObjectStoreLocation
        assert location.root == f"{s3_bucket}/d/{s3_bucket}/d"  # fsspec repeats the path


@pytest.mark.slow
class TestOpaquelyWrappedS3:
    """The S3 servers behind a wrapper the locations cannot see through (a logging or
    fault-injecting one): the generic class, which still removes an emptied directory that
    SeaweedFS's filer keeps (its ``rmdir`` refuses it; its ``<path>/`` key is deleted)."""

    @pytest.fixture
    def location(self, s3_server, s3_bucket):
        return Location(f"{s3_bucket}/contract",
                        filesystem=FaultyFileSystem(s3_server.filesystem()))

    def test_the_class_is_the_generic_one(self, location):
        assert type(location) is FsspecLocation and location.atomic_creates is False

    test_a_removed_tree_is_gone_from_listings = (
        LocationContract.test_a_removed_tree_is_gone_from_listings)
    test_remove_files_removes_exactly_the_named_files = (
        LocationContract.test_remove_files_removes_exactly_the_named_files)


@pytest.mark.parametrize(("url", "message"), [
    ("s3:/bucket/run", r"one slash after 's3:'.*did you mean 's3://bucket/run'"),
    ("memory:/run", r"did you mean 'memory://run'"),
    ("http://example.com/run", r"http:// cannot be a checkpoint prefix.*endpoint_url"),
    ("HTTPS://example.com/run", r"https:// cannot be a checkpoint prefix"),
])
def test_urls_no_one_means_are_refused_saying_what_was_meant(url, message):
    with pytest.raises(InvalidLocationError, match=message):
        Location(url)


@pytest.mark.parametrize("url", ["C:/data/run", "relative/run", "/tmp/a:/b"])
def test_paths_that_only_look_like_urls_stay_local_paths(url):
    assert isinstance(Location(url), LocalLocation)


def test_a_missing_s3_package_names_the_extra_that_installs_it():
    """Without s3fs, an s3:// prefix is refused with fsspec's reason and the pip command (in a
    fresh interpreter in which importing s3fs fails, as on a machine without it)."""
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from caffe2ckpt.errors import InvalidLocationError\n"
            "from caffe2ckpt.fs.location import Location\n"
            "try:\n    Location('s3://bucket/run')\n"
            "except InvalidLocationError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "'s3://bucket/run'" in out and 's3fs' in out, out
    assert 'pip install "caffe2ckpt[s3]"' in out, out
