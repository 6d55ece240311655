package grpclimit

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRootModuleHasNoGRPC guards the reason this package is a module of
// its own (ADR 18): the tollgate module, which every user requires, must
// not require grpc, protobuf or genproto, not even indirectly, so they
// never reach its go.mod or go.sum.
func TestRootModuleHasNoGRPC(t *testing.T) {
	for _, name := range []string{"../go.mod", "../go.sum"} {
		b, err := os.ReadFile(name)
		require.NoError(t, err)
		for _, dep := range []string{"google.golang.org/grpc", "google.golang.org/protobuf", "google.golang.org/genproto", "grpc-ecosystem"} {
			assert.False(t, strings.Contains(string(b), dep), "%s mentions %s", name, dep)
		}
	}
	mod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	assert.Contains(t, string(mod), "module github.com/tollgate-go/tollgate/grpclimit\n")
}
