package tollgate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/tollgate-go/tollgate/breaker"
)

func TestSourceAndPolicyStrings(t *testing.T) {
	assert.Equal(t, []string{"store", "fallback", "fail-open", "unknown"},
		[]string{SourceStore.String(), SourceFallback.String(), SourceFailOpen.String(), Source(9).String()})
	assert.Equal(t, []string{"fallback", "fail-open", "fail-closed", "unknown"},
		[]string{breaker.Fallback.String(), breaker.FailOpen.String(), breaker.FailClosed.String(), breaker.FailurePolicy(9).String()})
	assert.Equal(t, []string{"closed", "open", "half-open", "unknown"},
		[]string{breaker.Closed.String(), breaker.Open.String(), breaker.HalfOpen.String(), breaker.State(9).String()})
}
