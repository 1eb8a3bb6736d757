package relay

import (
	"errors"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// guestCodes are the codes a guest agent may give its errors; anything
// else it sends becomes Internal, so a guest cannot pose as carreld (e.g.
// with Unauthenticated).
var guestCodes = map[connect.Code]bool{
	connect.CodeInvalidArgument:    true,
	connect.CodeNotFound:           true,
	connect.CodePermissionDenied:   true,
	connect.CodeFailedPrecondition: true,
	connect.CodeDeadlineExceeded:   true,
	connect.CodeCanceled:           true,
	connect.CodeResourceExhausted:  true,
}

// MaxGuestMessage caps the guest's part of an error message.
const MaxGuestMessage = 1024

// GuestError rebuilds an error the guest agent sent: its code is limited to
// guestCodes, its message is truncated and stripped of control characters,
// and its metadata and details are dropped, since connect would otherwise
// copy the guest's headers and trailers into the response to our client.
func GuestError(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return connect.NewError(connect.CodeInternal, err)
	}
	code := ce.Code()
	if !guestCodes[code] {
		code = connect.CodeInternal
	}
	return connect.NewError(code, errors.New("guest agent: "+protocol.CleanText(ce.Message(), MaxGuestMessage)))
}
