// Incremental parser for a text/event-stream body read in arbitrary pieces.
//
// Feed it decoded text with push(); it calls onEvent({data, id, event}) once per complete event
// (a blank line ends an event). Lines and events may be split anywhere across pushes, including
// between the CR and LF of a CRLF. Comment lines (starting with ':', used as keepalives) are
// skipped. end() flushes what is left when the body closes without a final blank line.

export class SSEParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buffer = '';
    this.data = [];
    this.eventType = '';
    this.lastId = '';
  }

  push(text) {
    this.buffer += text;
    const buf = this.buffer;
    const lineEnd = /\r\n|\r|\n/g;
    let pos = 0;
    for (;;) {
      lineEnd.lastIndex = pos;
      const m = lineEnd.exec(buf);
      if (m === null) break;
      // NOTE: a CR as the very last character may be the first half of a CRLF: wait for more.
      if (m[0] === '\r' && m.index === buf.length - 1) break;
      const line = buf.slice(pos, m.index);
      pos = m.index + m[0].length;
      this.line(line);
    }
    this.buffer = buf.slice(pos);
  }

  end() {
    if (this.buffer.length > 0) {
      const rest = this.buffer.replace(/\r$/, '');
      this.buffer = '';
      this.line(rest);
    }
    this.line('');
  }

  line(line) {
    if (line === '') {
      if (this.data.length > 0) {
        const event = { data: this.data.join('\n'), id: this.lastId, event: this.eventType || 'message' };
        this.data = [];
        this.eventType = '';
        this.onEvent(event);
      }
      this.eventType = '';
      return;
    }
    if (line.startsWith(':')) return; // comment / keepalive
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') this.data.push(value);
    else if (field === 'event') this.eventType = value;
    else if (field === 'id') this.lastId = value;
    // 'retry' and unknown fields are ignored.
  }
}
