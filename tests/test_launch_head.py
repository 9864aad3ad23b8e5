"""`kernels.launch._launch_head`: a bound launch calls the C launch of a launcher that only passes its arguments
on (Triton 3.3-3.6's CudaLauncher) with exactly what that launcher would pass, and calls any other launcher."""

from mla_multi.kernels import launch


class _PassesOn:
    """The shape of Triton 3.6's CudaLauncher: scratch allocated where a kernel needs it, then the C launch."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.calls = []
        self.launch = lambda *args: self.calls.append(args)
        self.global_scratch_size = global_scratch_size
        self.profile_scratch_size = profile_scratch_size
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = "scratch" if self.global_scratch_size else None
        profile_scratch = "profile" if self.profile_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _Other(_PassesOn):
    """A launcher that does more than pass its arguments on (Triton 3.9's builds them anew)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, "annotations", *args)


def _through(run, head):
    run(4, 2, 1, 7, "function", *head, "x", 3)


def test_a_launcher_that_passes_its_arguments_on_is_skipped_for_its_c_launch():
    launcher = _PassesOn()
    run, head = launch._launch_head(launcher, ("metadata",))
    assert run is launcher.launch
    _through(run, head)
    launcher(4, 2, 1, 7, "function", ("metadata",), None, None, None, "x", 3)  # what `JITFunction.run` passes
    assert len(launcher.calls) == 2 and launcher.calls[0] == launcher.calls[1]


def test_a_kernel_with_scratch_memory_or_another_launcher_goes_through_the_launcher():
    for launcher in (_PassesOn(global_scratch_size=64), _PassesOn(profile_scratch_size=8), _Other()):
        run, head = launch._launch_head(launcher, ("metadata",))
        assert run is launcher and head == (("metadata",), None, None, None)  # what `JITFunction.run` passes
        _through(run, head)
        assert len(launcher.calls) == 1  # through the launcher's own __call__


def test_a_launcher_without_the_fields_goes_through_the_launcher():
    class Bare:
        def __call__(self, *args):
            self.args = args

    bare = Bare()
    run, head = launch._launch_head(bare, ("metadata",))
    assert run is bare and head == (("metadata",), None, None, None)


def test_launches_directly_follows_the_launch_hooks(monkeypatch):
    """A bound launch takes int addresses only while it launches directly: not while a Triton launch hook (a
    profiler's) is installed, when it goes back to Triton's own launch (the FLASHMLA adapters then pass tensors)."""
    from triton import knobs

    from mla_multi.kernels.launch import launches_directly

    assert launches_directly()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert not launches_directly()
