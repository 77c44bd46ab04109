// Last-Event-ID
