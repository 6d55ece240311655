package redistest

import "syscall"

// Signal sends sig to the server's process: SIGSTOP hangs it as a Redis
// behind a partition or a stopped VM hangs (connections are accepted by
// the kernel, nothing is answered), SIGCONT lets it run again. It calls
// t.Fatal when the server is not running or the signal cannot be sent.
// A stopped server is still killed at the end of the test.
func (s *Server) Signal(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("redistest: signal %v: %s is not running", sig, s.addrLocked())
	}
	if err := syscall.Kill(s.cmd.Process.Pid, sig); err != nil {
		s.t.Fatalf("redistest: signal %v to %s: %v", sig, s.addrLocked(), err)
	}
}
